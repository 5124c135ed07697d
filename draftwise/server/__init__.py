"""OpenAI-compatible HTTP server over the continuous-batching engine."""

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20  # a larger request body gets 413 (here: the CLI reads it without pydantic)
