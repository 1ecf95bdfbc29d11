"""The OpenAI-compatible HTTP API: the app, request schemas and limits, planning a request into the
engine's terms, streaming, logprobs, auth, the admin endpoints, drain on shutdown, and the backends it
talks to (a local serving loop, or Ray workers)."""
