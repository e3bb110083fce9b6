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
from torch import nn

from ..distributed.parallel import all_reduce_add_norm
from ..kernels.fp8_linear import MAX_ROWS as FP8_MAX_ROWS
from ..kernels.qk_norm_rotary import qk_norm_rotary, qk_norm_rotary_ref
from ..kernels.rms_norm import rms_norm, rms_norm_fp8
from ..kernels.rotary import rotary
from ..kernels.silu_mul import silu_mul, silu_mul_ref
from ..kernels.skinny_linear import MAX_ROWS, skinny_linear, skinny_linear_ref
from .attention import AttentionMetadata, attend
from .quant.linear import Fp8Linear, QuantizedRows, fuse_fp8
from .rotary import apply_rotary

# Inductor rounds to the model dtype wherever eager code does, so compiled and eager steps agree in bf16.
COMPILE_OPTIONS = {"emulate_precision_casts": True}


def linear(x: torch.Tensor | QuantizedRows, layer: nn.Linear, gated: bool = False, residual: torch.Tensor | None = None,
           rope: tuple[torch.Tensor, torch.Tensor] | None = None, rotary_cols: int = 0, head_dim: int = 0
           ) -> torch.Tensor:
    """``layer(x)`` for x [N, in]; ``gated``: ``layer`` is a fused gate/up projection and the result its SwiGLU
    product ``silu(gate) * up`` [N, out / 2]; ``residual``: plus this (the result's shape); ``rope`` (cos, sin)
    [N, 1, D]: among the first ``rotary_cols`` features, the first D of each head of ``head_dim`` (default D)
    rotated. On CUDA through the skinny-GEMM op: a
    decoding step's few rows (<= 32, bf16 or fp16) stream the weight through tllm_spec's kernel (product, add
    and rotation are its epilogue), anything else is cuBLAS and the stock ops (decided per call inside the op,
    so one compiled graph serves both); elsewhere the same stock ops (the op's reference). An FP8 ``layer``
    (:class:`~.quant.linear.Fp8Linear`) takes its own kernels, with the same epilogues, and x may then be rows its
    norm quantized already (:func:`norm_for`)."""
    cos, sin = (rope[0][:, 0], rope[1][:, 0]) if rope is not None else (None, None)
    if isinstance(layer, Fp8Linear):
        return layer.project(x, gated=gated, residual=residual, rope=None if rope is None else (cos, sin),
                             rotary_cols=rotary_cols, head_dim=head_dim)
    op = traced(torch.ops.tllm_spec.skinny_linear, skinny_linear) if x.is_cuda else skinny_linear_ref
    return op(x, layer.weight, layer.bias, gated=gated, residual=residual, rope_cos=cos, rope_sin=sin,
              rotary_cols=rotary_cols, head_dim=head_dim)


def few_row_kernels(x: torch.Tensor, attn: AttentionMetadata, max_rows: int = MAX_ROWS) -> bool:
    """Whether a layer runs the kernels made for generation steps of few rows: its RMSNorms as
    :func:`rms_norm_op`, the residual adds and the SwiGLU product as GEMM epilogues (:func:`linear`), which
    removes the launches that dominate such a step apart from its weight reads (and keeps the chain of tllm_spec
    kernels that launch as programmatic dependents unbroken). That is a generation step (no prompt in it) of at
    most ``MAX_ROWS`` rows in bf16/fp16 on CUDA: one request's chain or draft tree, or up to 8 requests' chains of
    3 drafts (on an H100, 8B shape, batch 8: the plain step 6.17 -> 5.90 ms, EAGLE-3's 7.63 -> 7.31 ms, the draft
    LM's 10.71 -> 10.18 ms); larger steps keep the stock ops, which Inductor fuses with each other (the ops' eager
    fallbacks would not). Under torch.compile the row count is compared with a host value: batch 1 is a
    compilation of its own anyway, the larger batches up to MAX_ROWS rows share one, and those beyond it one more;
    an eager step takes the compiled one's branch. ``max_rows``: a layer whose projections are all FP8 takes them
    up to the FP8 kernel's own bound (:func:`fp8_rows`)."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and not attn.context_lens
            and x.shape[0] <= max_rows)


def fp8_rows(*linears: nn.Module) -> int:
    """The few-row bound of a block whose projections are ``linears``: the FP8 kernel's (64 rows, where cuBLASLt
    takes over) when all are FP8 quantizing per token, so a batch-64 step keeps its norms quantizing, its SwiGLU,
    RoPE and residual adds in the GEMMs' epilogues (an H200, 8B shape: the FP8 step at batch 64 4.07 -> 3.83 ms);
    else the bf16 kernel's MAX_ROWS."""
    if all(isinstance(lin, Fp8Linear) and lin.quantizes_per_token for lin in linears):
        return FP8_MAX_ROWS
    return MAX_ROWS


def traced(op, fn):
    """The custom ``op`` under torch.compile (opaque to Inductor), its function ``fn`` in eager code: an eager
    call through the op's dispatcher costs 40-70 us of host time, which an eager prompt step pays hundreds of
    times. Compiled code calls a custom op as ``torch.ops.tllm_spec.<name>``, never through the object
    ``torch.library.custom_op`` returns: Dynamo guards on that object, and a guard on it cannot be saved with the
    step's traces (trace_cache.py)."""
    return op if torch.compiler.is_compiling() else fn


def eager_kernel(stock, kernel):
    """``kernel`` (one launch where the stock ops are several) in eager steps; under torch.compile the ``stock``
    ops, which Inductor fuses with their neighbours."""
    return stock if torch.compiler.is_compiling() else kernel


def norm(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """A stock RMSNorm module's result through :func:`rms_norm_op` (its kernel on CUDA); a norm whose weight is
    kept in another dtype (its product promotes) is the module itself."""
    if module.weight.dtype != x.dtype:
        return module(x)
    return traced(torch.ops.tllm_spec.rms_norm, rms_norm)(x, module.weight, module.variance_epsilon)


def norm_for(x: torch.Tensor, module: nn.Module, layer: nn.Module | None) -> torch.Tensor | QuantizedRows:
    """:func:`norm` as the projection ``layer`` takes it: for an FP8 one that quantizes per token, the norm's
    kernel quantizes its rows too (:func:`~tllm_spec.kernels.rms_norm.rms_norm_fp8`: no quantization kernel
    between the norm and the GEMM). None (a mixture of experts, whose first GEMMs are the experts'): the norm."""
    if not (isinstance(layer, Fp8Linear) and layer.quantizes_per_token and module.weight.dtype == x.dtype):
        return norm(x, module)
    q, scale = traced(torch.ops.tllm_spec.rms_norm_fp8, rms_norm_fp8)(x, module.weight, module.variance_epsilon,
                                                                     layer.scale_ub)
    return QuantizedRows(q, scale, x.dtype)


def output_projection(x: torch.Tensor, layer: nn.Linear, tp_group: str | None, residual: torch.Tensor | None,
                      partial: bool = False) -> torch.Tensor:
    """A block's last projection plus ``residual``: on one GPU the add is the GEMM's epilogue (:func:`linear`);
    tensor parallel, the partial sums are all-reduced and the residual added after (one kernel in a decoding
    step: :func:`~tllm_spec.distributed.parallel.all_reduce_add_norm`). ``partial``: this rank's partial sums
    alone (the caller all-reduces them, with its norm: :class:`DecoderLayer`)."""
    if tp_group is None:
        return linear(x, layer, residual=residual)
    if partial:
        return linear(x, layer)
    return all_reduce_add_norm(linear(x, layer), residual, None, 0.0, tp_group)[0]


def fuse_linears(linears: list[nn.Linear]) -> nn.Linear:
    """One ``nn.Linear`` computing ``cat([l(x) for l in linears], -1)``; the sources' weights (and biases) become
    views of the fused ones. All sources share in_features, dtype, device and bias presence (FP8 ones:
    :func:`~.quant.linear.fuse_fp8`)."""
    if any(isinstance(lin, Fp8Linear) for lin in linears):
        if not all(isinstance(lin, Fp8Linear) for lin in linears):
            raise ValueError("fuse_linears: FP8 and unquantized projections cannot share one GEMM")
        return fuse_fp8(linears)
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
        # this layer's KV cache tensors once bound (bind_kv_cache): buffers, so that a torch.compile of one layer
        # serves every layer (they are inputs of the compiled code, where an index would be baked into it)
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)
        self.kv_scales = (1.0, 1.0)  # an FP8 cache's per-tensor (k, v) scales for this layer

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor, scales: tuple[float, float] = (1.0, 1.0)
                      ) -> None:
        """Attend over these tensors (KV layer ``kv_layer`` of the engine's cache) from now on."""
        self.k_cache, self.v_cache, self.kv_scales = k_cache, v_cache, scales

    @classmethod
    def from_linears(cls, q: nn.Linear, k: nn.Linear, v: nn.Linear, o: nn.Linear, head_dim: int, kv_layer: int,
                     scale: float, **kwargs) -> Attention:
        return cls(fuse_linears([q, k, v]), o, q.out_features // head_dim, k.out_features // head_dim, head_dim,
                   kv_layer, scale, **kwargs)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: AttentionMetadata,
                residual: torch.Tensor | None = None, rotary_epilogue: bool = False, partial: bool = False
                ) -> torch.Tensor:
        """x [N, H_in] -> [N, H] (plus ``residual``; ``partial``: see :func:`output_projection`);
        ``rotary_epilogue`` (the few-row path): q and k are rotated by the qkv GEMM (:func:`linear`) where no q/k
        norm comes between (also a partial rotary embedding's first features of each head); with q/k norms, the
        norms and the rotation are one kernel after it (kernels/qk_norm_rotary.py)."""
        q_size, kv_size = self.q_size, self.kv_size
        whole = rope[0].shape[-1] == self.head_dim  # else the first features of each head only (GLM-4.5)
        if rotary_epilogue and self.q_norm is None:
            qkv = linear(x, self.qkv_proj, rope=rope, rotary_cols=q_size + kv_size, head_dim=self.head_dim)
            q = qkv[:, :q_size].view(-1, self.num_heads, self.head_dim)
            k = qkv[:, q_size:q_size + kv_size].view(-1, self.num_kv_heads, self.head_dim)
        elif rotary_epilogue and self.q_norm.weight.dtype == self.k_norm.weight.dtype == x.dtype:
            qkv = linear(x, self.qkv_proj)
            op = traced(torch.ops.tllm_spec.qk_norm_rotary, qk_norm_rotary) if qkv.is_cuda else qk_norm_rotary_ref
            qk = op(qkv, self.q_norm.weight, self.k_norm.weight, self.q_norm.variance_epsilon, rope[0][:, 0],
                    rope[1][:, 0], self.num_heads, self.num_kv_heads)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        elif self.q_norm is None and whole:  # q and k rotated as one tensor: one kernel; q stays a view for attend
            qkv = linear(x, self.qkv_proj)
            qk = qkv[:, :q_size + kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
            q, k = eager_kernel(apply_rotary, rotary)(qk, *rope).split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            qkv = linear(x, self.qkv_proj)
            q = qkv[:, :q_size].view(-1, self.num_heads, self.head_dim)
            k = qkv[:, q_size:q_size + kv_size].view(-1, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rotate_part(q, rope), rotate_part(k, rope)
        v = qkv[:, q_size + kv_size:].view(-1, self.num_kv_heads, self.head_dim)
        kv_layer = self.kv_layer if self.k_cache is None else (self.k_cache, self.v_cache, *self.kv_scales)
        out = attend(kv_layer, q, k, v, attn, self.scale, self.sliding_window)
        return output_projection(out.flatten(1), self.o_proj, self.tp_group, residual, partial)


def rotate_part(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [N, heads, D] with its first ``rope``-width features of each head rotated (all of them when the table is
    D wide; GLM-4.5's partial rotary embedding rotates half), the rest passed through."""
    rotate = eager_kernel(apply_rotary, rotary)
    width = rope[0].shape[-1]
    if width == x.shape[-1]:
        return rotate(x, *rope)
    return torch.cat([rotate(x[..., :width], *rope), x[..., width:]], dim=-1)


class MLP(nn.Module):
    """SwiGLU with one fused gate/up GEMM: down(silu(gate(x)) * up(x)). Tensor parallel (``tp_group``): this
    rank's slice of the intermediate size, the down projection's partial sums all-reduced."""

    def __init__(self, gate_up_proj: nn.Linear, down_proj: nn.Linear):
        super().__init__()
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj
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
            act = eager_kernel(silu_mul_ref, silu_mul)(linear(x, self.gate_up_proj))
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
        attention, mlp = self.self_attn, self.mlp
        rows = MAX_ROWS if attention.tp_group is not None else fp8_rows(
            attention.qkv_proj, attention.o_proj, getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None))
        if few_row_kernels(hidden, attn, rows):
            x = norm_for(hidden, self.input_layernorm, self.self_attn.qkv_proj)
            if self.self_attn.tp_group is None:
                hidden = self.self_attn(x, rope, attn, residual=hidden, rotary_epilogue=True)
                first = getattr(self.mlp, "gate_up_proj", None)  # None: a mixture of experts (model/moe.py)
                x = norm_for(hidden, self.post_attention_layernorm, first)
            else:  # the all-reduce, the residual add and the norm: one kernel
                partial = self.self_attn(x, rope, attn, rotary_epilogue=True, partial=True)
                post = self.post_attention_layernorm
                hidden, x = all_reduce_add_norm(partial, hidden, post.weight, post.variance_epsilon,
                                                self.self_attn.tp_group)
            return self.mlp(x, gated=True, residual=hidden)
        if attn.context_lens and hidden.is_cuda:  # a prompt step never runs compiled: one norm kernel, not six ops
            hidden = hidden + self.self_attn(norm(hidden, self.input_layernorm), rope, attn)
            return hidden + self.mlp(norm(hidden, self.post_attention_layernorm))
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, attn)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))
