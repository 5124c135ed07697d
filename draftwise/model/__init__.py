"""The network: a Llama-family decoder (config, RMSNorm, rotary embedding, grouped-query attention
over a paged KV view, SwiGLU), run on any device, stopping after any layer for self-speculation."""
