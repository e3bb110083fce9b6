"""The target: a stock Hugging Face causal LM run on a packed batch through paged attention (its layers, RoPE,
the KV cache, tensor-parallel-ready fused decoder)."""
