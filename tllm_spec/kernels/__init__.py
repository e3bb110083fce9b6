"""Kernels: one op per file, each with a torch reference of the same signature (the CPU path)."""
