"""The engine's only door to a model: `ModelRunner` feeds a ragged batch of rows through a model over
its paged KV cache and hands back the logits asked for; rows grow, roll back and free by bookkeeping."""
