"""Target model families, written in plain PyTorch over a paged KV cache."""
