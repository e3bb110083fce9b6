"""Fp8Linear: the one FP8 linear every quantization path produces (checkpoint formats and online quantization).

An ``nn.Linear`` whose weight is FP8 (E4M3) [N, K] with fp32 scales, per output channel [N] (a per-tensor scale
is stored as N equal channel scales: the same numbers) or per 128 x 128 block [ceil(N/128), ceil(K/128)]; the
activation is quantized per token (``scale_ub`` clamps its maximum), per token and 128 columns (block scales) or
with a static ``input_scale``; the bias stays in the compute dtype. Being an ``nn.Linear``, it stands wherever a
stock module has one (the HF decoder layers call it as before); the fused layers reach its kernel through
:meth:`Fp8Linear.project`. Fused q/k/v and gate/up projections stay one GEMM: the parts' channel (or block) scales
are concatenated, their static input scales merged to the largest (:func:`fuse_fp8`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ...kernels.fp8_linear import FP8, FP8_MAX, GROUP, dequantize_weight, fp8_linear, fp8_linear_ref


class QuantizedRows(NamedTuple):
    """Activation rows already quantized per token (the RMSNorm kernel's FP8 output,
    :func:`~tllm_spec.kernels.rms_norm.rms_norm_fp8`) for an :class:`Fp8Linear` that quantizes per token:
    FP8 [M, K], fp32 scales [M, 1], and the dtype the rows had (the projection's result dtype)."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


class Fp8Linear(nn.Linear):
    """``y = x @ dequant(weight).T + bias`` with FP8 weight and activation (:mod:`tllm_spec.kernels.fp8_linear`)."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                 input_scale: torch.Tensor | None = None, block_scales: bool = False, scale_ub: float | None = None):
        nn.Module.__init__(self)
        if weight.dtype != FP8:
            raise ValueError(f"Fp8Linear: the weight must be float8_e4m3fn, got {weight.dtype}")
        self.out_features, self.in_features = weight.shape
        expected = ((-(-weight.shape[0] // GROUP), -(-weight.shape[1] // GROUP)) if block_scales
                    else (weight.shape[0],))
        if tuple(weight_scale.shape) != expected:
            raise ValueError(f"Fp8Linear: weight scales of shape {list(weight_scale.shape)} for a weight "
                             f"{list(weight.shape)}; expected {list(expected)}")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.register_buffer("weight_scale", weight_scale.float().contiguous())
        self.register_buffer("input_scale", None if input_scale is None else input_scale.float().reshape(1))
        self.block_scales, self.scale_ub = block_scales, scale_ub

    @classmethod
    def quantize(cls, layer: nn.Linear, device: torch.device | str | None = None) -> Fp8Linear:
        """Online FP8: ``layer``'s weight quantized per output channel (scale = the row's maximum / 448) on
        ``device`` (default: where it is); activations dynamic per token."""
        w = layer.weight.detach().to(device).float()
        scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        weight = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        bias = None if layer.bias is None else layer.bias.detach().to(device)
        return cls(weight, scale, bias)

    def extra_repr(self) -> str:
        kind = "block 128x128" if self.block_scales else "per channel"
        act = "static" if self.input_scale is not None else "dynamic"
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 {kind}, {act} activations"

    def dequantized(self) -> torch.Tensor:
        """The weight the FP8 values and scales stand for, fp32 [N, K]."""
        return dequantize_weight(self.weight, self.weight_scale, (GROUP, GROUP) if self.block_scales else None)

    @property
    def quantizes_per_token(self) -> bool:
        """Whether its activation is quantized per token (dynamic, channel-scaled weight): then it also takes
        :class:`QuantizedRows`."""
        return self.input_scale is None and not self.block_scales

    def project(self, x: torch.Tensor | QuantizedRows, gated: bool = False, residual: torch.Tensor | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None, rotary_cols: int = 0,
                head_dim: int = 0) -> torch.Tensor:
        """x [M, K] (or :class:`QuantizedRows`, when :attr:`quantizes_per_token`) -> [M, N] (``gated``: the SwiGLU
        product [M, N/2]; ``residual``: plus it; ``rope`` (cos, sin) [M, D]: the first D features of each head of
        ``head_dim`` (default D) among the first ``rotary_cols`` rotated), the kernels' op on CUDA (opaque to
        torch.compile), the reference elsewhere."""
        rows, x_scale, out_dtype = (x.q, x.scale, x.dtype) if isinstance(x, QuantizedRows) else (x, None, None)
        if not rows.is_cuda:
            op = fp8_linear_ref
        else:
            op = torch.ops.tllm_spec.fp8_linear if torch.compiler.is_compiling() else fp8_linear
        cos, sin = rope if rope is not None else (None, None)
        return op(rows, self.weight, self.weight_scale, self.bias, self.input_scale, self.block_scales, self.scale_ub,
                  gated, residual, x_scale, out_dtype, cos, sin, rotary_cols, head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)


def fuse_fp8(linears: list[Fp8Linear]) -> Fp8Linear:
    """One Fp8Linear computing ``cat([l(x) for l in linears], -1)``; the sources' weights, scales and biases become
    views of the fused ones (block scales: each part's rows a whole number of blocks). Static input scales merge
    to the largest: every part's activation then quantizes without clipping."""
    first = linears[0]
    if any(lin.block_scales != first.block_scales or lin.scale_ub != first.scale_ub
           or (lin.input_scale is None) != (first.input_scale is None) for lin in linears):
        raise ValueError("fuse_fp8: the projections' FP8 schemes differ (scale kind, activation scheme)")
    if first.block_scales and any(lin.out_features % GROUP for lin in linears):
        raise ValueError(f"fuse_fp8: block-scaled projections of {[lin.out_features for lin in linears]} rows; "
                         f"each must be a multiple of {GROUP} to fuse")
    input_scale = None if first.input_scale is None else torch.stack([lin.input_scale for lin in linears]).max()
    bias = None if first.bias is None else torch.cat([lin.bias.detach() for lin in linears])
    fused = Fp8Linear(torch.cat([lin.weight.detach() for lin in linears]),
                      torch.cat([lin.weight_scale for lin in linears]), bias, input_scale, first.block_scales,
                      first.scale_ub)
    start = start_scale = 0
    for lin in linears:
        rows = lin.out_features
        scale_rows = lin.weight_scale.shape[0]
        lin.weight = nn.Parameter(fused.weight[start:start + rows], requires_grad=False)
        lin.weight_scale = fused.weight_scale[start_scale:start_scale + scale_rows]
        lin.input_scale = fused.input_scale
        if bias is not None:
            lin.bias = nn.Parameter(fused.bias[start:start + rows], requires_grad=False)
        start, start_scale = start + rows, start_scale + scale_rows
    return fused


def quantize_linears(module: nn.Module, skip: tuple[str, ...] = ("lm_head", "head"), device: torch.device | str | None = None
                     ) -> int:
    """Online FP8: replace every ``nn.Linear`` under ``module`` (not already FP8, not named in ``skip`` as the last
    part of its name: output heads, an MTP module's ``shared_head.head``, stay) by :meth:`Fp8Linear.quantize` on ``device``; each source weight is dropped as soon as it is
    replaced, so the peak is the quantized model plus one weight. Returns how many were quantized."""
    targets = [(name, child) for name, child in module.named_modules()
               if type(child) is nn.Linear and name.rsplit(".", 1)[-1] not in skip]
    for name, child in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, Fp8Linear.quantize(child, device))
        child.weight = None
    return len(targets)
