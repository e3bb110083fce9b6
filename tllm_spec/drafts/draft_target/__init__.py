"""A draft LM inside the target's step (TensorRT-LLM DRAFT_TARGET_ONE_MODEL): loading and the worker."""
