"""Requests and the step loop: continuous batching over the paged KV cache (scheduler), each step
proposing, verifying in one target pass and committing per row; a failing row fails alone."""
