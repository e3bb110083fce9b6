"""The engine: requests, scheduling, the model runner (KV cache, step inputs, CUDA graphs)."""
