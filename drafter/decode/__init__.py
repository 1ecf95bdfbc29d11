"""The decode step: the engine (continuous batching over a slot pool), the speculative step (propose, verify,
accept), the Drafter protocol and the controller that chooses k, rejection sampling, sampling parameters,
requests and stop rules, capacity, acceptance statistics, logprobs."""
