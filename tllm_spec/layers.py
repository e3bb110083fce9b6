"""Compact decoder building blocks with fused projections: q/k/v as one GEMM, gate/up as one GEMM.

They are built from already loaded modules (a stock HF decoder layer, an EAGLE-3 midlayer) by
:func:`fuse_linears`, which concatenates the weights once and re-points the source ``nn.Linear`` weights at
views of the fused tensor: no second copy of any weight, and the stock modules keep working (the training
code and the HF fallback still use them). The maths is the stock modules' to the last rounding step in fp32,
so greedy outputs stay token-identical to HF ``generate`` (bf16/fp16 decoding steps' projections run the
skinny-GEMM kernel, whose sums round differently from cuBLAS's).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, attend
from .kernels.rms_norm import rms_norm_op
from .kernels.skinny_linear import MAX_ROWS, skinny_linear_op
from .parallel import all_reduce

# Inductor rounds to the model dtype wherever eager code does, so compiled and eager steps agree in bf16.
COMPILE_OPTIONS = {"emulate_precision_casts": True}


def linear(x: torch.Tensor, layer: nn.Linear, gated: bool = False, residual: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``layer(x)`` for x [N, in]; ``gated``: ``layer`` is a fused gate/up projection and the result its SwiGLU
    product ``silu(gate) * up`` [N, out / 2]; ``residual``: plus this (the result's shape). On CUDA through the
    skinny-GEMM op: a decoding step's few rows (<= 16, bf16 or fp16) stream the weight through tllm_spec's
    kernel (product and add are its epilogue), anything else is cuBLAS and the stock ops (decided per call
    inside the op, so one compiled graph serves both); elsewhere the module itself."""
    if x.is_cuda:
        return skinny_linear_op(x, layer.weight, layer.bias, gated, residual)
    y = layer(x)
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y if residual is None else residual + y


def one_request_kernels(x: torch.Tensor, attn: AttentionMetadata) -> bool:
    """Whether a layer runs the kernels made for one request's generation step: its RMSNorms as
    :func:`rms_norm_op`, the residual adds and the SwiGLU product as GEMM epilogues (:func:`linear`), which
    removes the launches that dominate such a step apart from its weight reads. That is a generation step
    (no prompt in it) of at most ``tokens_per_request`` rows, i.e. one request, in bf16/fp16 on CUDA; larger
    steps keep the stock ops, which Inductor fuses with each other (the ops' eager fallbacks would not). Under
    torch.compile the row count is compared with a host value: batch 1 is a compilation of its own anyway, and
    every larger batch takes the other branch, so one compilation still serves them all; an eager step takes
    the compiled one's branch."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and not attn.context_lens
            and x.shape[0] <= attn.tokens_per_request and attn.tokens_per_request <= MAX_ROWS)


def norm(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """A stock RMSNorm module's result through :func:`rms_norm_op` (its kernel on CUDA); a norm whose weight is
    kept in another dtype (its product promotes) is the module itself."""
    if module.weight.dtype != x.dtype:
        return module(x)
    return rms_norm_op(x, module.weight, module.variance_epsilon)


def output_projection(x: torch.Tensor, layer: nn.Linear, tp_group: str | None, residual: torch.Tensor | None
                      ) -> torch.Tensor:
    """A block's last projection plus ``residual``: on one GPU the add is the GEMM's epilogue (:func:`linear`);
    tensor parallel, the partial sums are all-reduced first and the residual added after."""
    if tp_group is None:
        return linear(x, layer, residual=residual)
    out = all_reduce(linear(x, layer), tp_group)
    return out if residual is None else residual + out


def fuse_linears(linears: list[nn.Linear]) -> nn.Linear:
    """One ``nn.Linear`` computing ``cat([l(x) for l in linears], -1)``; the sources' weights (and biases) become
    views of the fused ones. All sources share in_features, dtype, device and bias presence."""
    has_bias = linears[0].bias is not None
    if any((lin.bias is not None) != has_bias or lin.in_features != linears[0].in_features for lin in linears):
        raise ValueError("fuse_linears: the projections differ in input size or bias presence")
    weight = torch.cat([lin.weight.detach() for lin in linears])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    fused.bias = nn.Parameter(torch.cat([lin.bias.detach() for lin in linears]), requires_grad=False) if has_bias \
        else None
    start = 0
    for lin in linears:
        rows = lin.out_features
        lin.weight = nn.Parameter(fused.weight[start:start + rows], requires_grad=False)
        if has_bias:
            lin.bias = nn.Parameter(fused.bias[start:start + rows], requires_grad=False)
        start += rows
    return fused


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryTable(nn.Module):
    """cos/sin of every position up to ``max_positions``, computed once the way the stock rotary module does
    (fp32 angles, ``attention_scaling``, cast to the model dtype); a forward is a row gather."""

    STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, max_positions: int, dtype: torch.dtype):
        super().__init__()
        self.attention_scaling, self.dtype = attention_scaling, dtype
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.resize(max_positions)

    @classmethod
    def from_hf(cls, rotary: nn.Module, max_positions: int, dtype: torch.dtype) -> RotaryTable:
        """From a stock HF rotary-embedding module (its ``inv_freq`` and ``attention_scaling``)."""
        return cls(rotary.inv_freq, rotary.attention_scaling, max_positions, dtype)

    def resize(self, max_positions: int) -> None:
        positions = torch.arange(max_positions, device=self.inv_freq.device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * self.attention_scaling).to(self.dtype)
        self.sin = (emb.sin() * self.attention_scaling).to(self.dtype)

    @property
    def max_positions(self) -> int:
        return self.cos.shape[0]

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] int64 -> (cos, sin) [N, 1, D] (broadcast over heads)."""
        return self.cos[positions][:, None], self.sin[positions][:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D]; cos, sin [N, 1, D]."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Self-attention with one fused qkv GEMM, optional per-head q/k RMSNorm (Qwen3), sliding window (Mistral,
    Qwen2), K/V written to KV layer ``kv_layer`` of the paged cache.

    Tensor parallel (``tp_group`` names the process group): qkv_proj holds this rank's heads, o_proj the
    matching input columns, and its partial sums are all-reduced. None (one GPU): no collective at all."""

    def __init__(self, qkv_proj: nn.Linear, o_proj: nn.Linear, num_heads: int, num_kv_heads: int, head_dim: int,
                 kv_layer: int, scale: float, sliding_window: int | None = None, q_norm: nn.Module | None = None,
                 k_norm: nn.Module | None = None):
        super().__init__()
        self.qkv_proj, self.o_proj, self.q_norm, self.k_norm = qkv_proj, o_proj, q_norm, k_norm
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.kv_layer, self.scale, self.sliding_window = kv_layer, scale, sliding_window
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.tp_group: str | None = None

    @classmethod
    def from_linears(cls, q: nn.Linear, k: nn.Linear, v: nn.Linear, o: nn.Linear, head_dim: int, kv_layer: int,
                     scale: float, **kwargs) -> Attention:
        return cls(fuse_linears([q, k, v]), o, q.out_features // head_dim, k.out_features // head_dim, head_dim,
                   kv_layer, scale, **kwargs)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: AttentionMetadata,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, H_in] -> [N, H] (plus ``residual``, :func:`output_projection`)."""
        qkv = linear(x, self.qkv_proj)
        q_size, kv_size = self.q_size, self.kv_size
        if self.q_norm is None:  # q and k rotated as one tensor: one kernel; q stays a view for attend
            qk = qkv[:, :q_size + kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
            q, k = apply_rotary(qk, *rope).split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q = self.q_norm(qkv[:, :q_size].view(-1, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, q_size:q_size + kv_size].view(-1, self.num_kv_heads, self.head_dim))
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        v = qkv[:, q_size + kv_size:].view(-1, self.num_kv_heads, self.head_dim)
        out = attend(self.kv_layer, q, k, v, attn, self.scale, self.sliding_window)
        return output_projection(out.flatten(1), self.o_proj, self.tp_group, residual)


class MLP(nn.Module):
    """SwiGLU with one fused gate/up GEMM: down(silu(gate(x)) * up(x)). Tensor parallel (``tp_group``): this
    rank's slice of the intermediate size, the down projection's partial sums all-reduced."""

    def __init__(self, gate_up_proj: nn.Linear, down_proj: nn.Linear):
        super().__init__()
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj
        self.intermediate = gate_up_proj.out_features // 2
        self.tp_group: str | None = None

    @classmethod
    def from_linears(cls, gate: nn.Linear, up: nn.Linear, down: nn.Linear) -> MLP:
        return cls(fuse_linears([gate, up]), down)

    def forward(self, x: torch.Tensor, gated: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, H] -> [N, H] (plus ``residual``, :func:`output_projection`); ``gated``: the SwiGLU product is the
        gate/up GEMM's epilogue (:func:`linear`)."""
        if gated:
            act = linear(x, self.gate_up_proj, gated=True)
        else:
            gate, up = linear(x, self.gate_up_proj).split(self.intermediate, dim=-1)
            act = F.silu(gate) * up
        return output_projection(act, self.down_proj, self.tp_group, residual)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: h + attn(norm(h)), then h + mlp(norm(h)) (the stock Llama/Qwen/Mistral layer)."""

    def __init__(self, input_layernorm: nn.Module, self_attn: Attention, post_attention_layernorm: nn.Module,
                 mlp: MLP):
        super().__init__()
        self.input_layernorm, self.self_attn = input_layernorm, self_attn
        self.post_attention_layernorm, self.mlp = post_attention_layernorm, mlp

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: AttentionMetadata
                ) -> torch.Tensor:
        """hidden [N, H] -> [N, H]."""
        if one_request_kernels(hidden, attn):
            hidden = self.self_attn(norm(hidden, self.input_layernorm), rope, attn, residual=hidden)
            return self.mlp(norm(hidden, self.post_attention_layernorm), gated=True, residual=hidden)
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, attn)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))
