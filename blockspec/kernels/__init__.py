"""Triton kernels, each beside the plain-PyTorch reference that defines it."""
