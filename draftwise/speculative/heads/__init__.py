"""Draft heads: small networks that read the target's hidden states (Medusa)."""
