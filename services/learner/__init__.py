"""The asynchronous learner: trains the drafter from the replay buffer, publishes versions, and runs canaries."""
