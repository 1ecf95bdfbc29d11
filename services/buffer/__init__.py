"""The replay buffer: outcome records written by workers and read by the learner, in memory or in Redis
streams (connect.py opens one from a spec)."""
