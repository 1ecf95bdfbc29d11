"""The verifier worker: the serving loop over the engine (continuous batching), one engine per drafter
version being served, detokenizing, and the watcher that hot-swaps drafters."""
