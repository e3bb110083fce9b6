"""Tensor parallelism: the process group, collectives and sharded loading."""
