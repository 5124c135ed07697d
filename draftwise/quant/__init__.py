"""Low-bit linear layers (int4 groups kept from GGUF Q4_K, int8 per channel) and the native AVX-512
kernels that run them, batch-invariant so that verifying k tokens computes what k steps compute."""
