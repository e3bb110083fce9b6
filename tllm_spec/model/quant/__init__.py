"""Quantization: one small module per checkpoint format, all producing the same :class:`~.linear.Fp8Linear`; the
compute path never sees the format."""
