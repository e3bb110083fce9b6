"""MTP modules: ``x = eh_proj(cat(enorm(emb(t_{i+1})), hnorm(h_i)))`` -> a decoder block of the target's own
class (its own KV layer) -> ``shared_head.norm`` -> the module's own ``shared_head.head`` when its checkpoint has
a distinct one (Step-3.5-style per-module heads), else the target's ``lm_head``. Embedding and rotary embedding
are the target's. The block is whatever the target's class builds at layer L + i: a MoE block for GLM-4.5 (its
``first_k_dense_replace`` dense layers come first), a dense one for Llama-like targets.

Tensor parallel: every rank holds the whole modules (the block is built from the target's unsharded config, so its
fused layer has no ``tp_group``: no collective), read whole from the checkpoint; draft logits through the target's
vocabulary-parallel ``lm_head`` are gathered as the target's rows are, and an own head stays whole."""
from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from ...distributed.parallel import TensorParallel, all_ranks_agree, gather_vocab
from ...model.attention import AttentionMetadata
from ...model.decoder import fused_layer
from ...model.layers import DecoderLayer
from ...model.rotary import RotaryTable
from .checkpoint import HEAD_KEY, OWN_KEYS, MTPCheckpoint, save_mtp_weights

_OWN_PREFIXES = tuple(k.split(".")[0] for k in OWN_KEYS)


class MTPModule(nn.Module):
    """One MTP module. Its block is ``layer_cls(config, layer_idx=kv_layer)``: the target's decoder-layer class,
    so it reaches tllm_spec attention through transformers' AttentionInterface and writes KV layer ``kv_layer``.
    With ``vocab_size`` it owns an output head ``shared_head.head`` [V, H]."""

    def __init__(self, config: PretrainedConfig, layer_cls: type[nn.Module], norm_cls: type[nn.Module],
                 kv_layer: int, vocab_size: int | None = None):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.kv_layer = kv_layer
        heads = config.num_attention_heads
        self.kv_shape = (getattr(config, "num_key_value_heads", None) or heads,
                         getattr(config, "head_dim", None) or hidden // heads)
        self.enorm = norm_cls(hidden, eps=eps)
        self.hnorm = norm_cls(hidden, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = layer_cls(_block_config(config, kv_layer), layer_idx=kv_layer)
        self.shared_head = nn.ModuleDict({"norm": norm_cls(hidden, eps=eps)})
        if vocab_size is not None:
            self.shared_head["head"] = nn.Linear(hidden, vocab_size, bias=False)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor], attn: AttentionMetadata) -> torch.Tensor:
        """embeds [N, H] (token t_{i+1}), hidden [N, H] (h_i) -> block output before shared_head.norm [N, H].
        position_embeddings: the HF rotary's (cos, sin) [1, N, D], or a RotaryTable's when the block is fused."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        if isinstance(self.block, DecoderLayer):
            return self.block(x, position_embeddings, attn)
        out = self.block(x[None], attention_mask=None, position_ids=attn.positions[None],
                         position_embeddings=position_embeddings, tllm_attn=attn)
        return (out[0] if isinstance(out, tuple) else out)[0]  # transformers < 5 returned a tuple

    def canonical_state(self) -> dict[str, torch.Tensor]:
        """Weights and persistent buffers (a MoE router's ``e_score_correction_bias``) under canonical checkpoint
        keys (block keys without the ``block.`` prefix); a module whose block is fused (inference) has none."""
        if isinstance(self.block, DecoderLayer):
            raise ValueError(  # noqa: TRY004 (a fused block is a valid module, in the wrong state for this)
                "canonical MTP keys name the stock block's tensors; this module's block is fused")
        return {k.removeprefix("block."): v for k, v in self.state_dict().items()}

    def load_canonical(self, state: dict[str, torch.Tensor], name_of) -> None:
        """Copy canonical weights and buffers in; ``name_of(key)`` is the on-disk name used in error messages."""
        expected = self.canonical_state()
        for key, param in expected.items():
            if key not in state:
                raise ValueError(f"{name_of(key)}: required MTP tensor missing from the checkpoint")
            if state[key].shape != param.shape:
                raise ValueError(f"{name_of(key)}: expected shape {list(param.shape)}, found {list(state[key].shape)}")
        unexpected = sorted(set(state) - set(expected))
        if unexpected:
            raise ValueError(f"{name_of(unexpected[0])}: unexpected tensor for an MTP module built from "
                             f"{type(self.block).__name__} (all unexpected: {[name_of(k) for k in unexpected]})")
        self.load_state_dict({_module_key(k): v for k, v in state.items()})


class MTPDraftModel(nn.Module):
    """The MTP modules of one checkpoint plus the target's embedding, head and rotary embedding.

    ``mtp_hidden_feedback`` picks the hidden handed on (to the next module, or to the next MTP-Eagle step):
    ``"pre_norm"`` the block output, ``"post_norm"`` after ``shared_head.norm``. ``parallel``: the target is
    tensor parallel, its ``lm_head`` this rank's rows of a ``vocab_size`` vocabulary.
    """

    def __init__(self, mtp_modules: list[MTPModule], embed_tokens: nn.Module, lm_head: nn.Module,
                 rotary_emb: nn.Module, mtp_hidden_feedback: str, parallel: TensorParallel | None = None,
                 vocab_size: int | None = None):
        super().__init__()
        self.mtp_modules = nn.ModuleList(mtp_modules)
        self.embed_tokens, self.lm_head, self.rotary_emb = embed_tokens, lm_head, rotary_emb
        self.parallel, self.vocab_size = parallel, vocab_size
        self.feed_post_norm = mtp_hidden_feedback == "post_norm"
        self.rope_table: RotaryTable | None = None  # set by fuse()

    @classmethod
    def from_checkpoint(cls, ckpt: MTPCheckpoint, target, mtp_hidden_feedback: str, dtype: torch.dtype,
                        device: torch.device) -> MTPDraftModel:
        """Build one module per checkpoint module from ``target`` (a TargetModel); module i owns KV layer L + i.
        A module's ``shared_head.head`` is kept only where it differs from the target's ``lm_head`` (DeepSeek-V3
        stores a copy; Step-3.5 trains one head per module). Each module is allocated once, in its final dtypes
        (a GLM-4.5-Air MoE block is 9 GB in fp32)."""
        config, layer = target.config, target.decoder.layers[0]
        layer_cls = type(getattr(layer, "_orig_mod", layer))  # the class itself, even if torch.compile wrapped it
        norm_cls = type(target.decoder.norm)
        check_dense_target(config, norm_cls)
        mtp_modules = []
        for i, state in enumerate(ckpt.modules):
            state = _without_copied_head(state, target.lm_head.weight, target.vocab_size, target.parallel,
                                         ckpt.disk_name(i, HEAD_KEY))
            with torch.device("meta"):
                module = MTPModule(config, layer_cls, norm_cls, target.num_layers + i,
                                   state[HEAD_KEY].shape[0] if HEAD_KEY in state else None)
            module = _allocate(module, dtype, target.hf._keep_in_fp32_modules_strict, device)
            module.load_canonical(state, lambda key, i=i: ckpt.disk_name(i, key))
            mtp_modules.append(module.eval())
        return cls(mtp_modules, target.decoder.embed_tokens, target.lm_head, target.decoder.rotary_emb,
                   mtp_hidden_feedback, target.parallel, target.vocab_size)

    def fuse(self, max_positions: int) -> None:
        """Inference fast path: every module's block as a fused layer (one q/k/v and one gate/up GEMM) and a
        precomputed RoPE table for positions < max_positions; blocks of an unsupported kind keep the stock path."""
        if self.rope_table is not None:
            if self.rope_table.max_positions < max_positions:
                self.rope_table.resize(max_positions)
            return
        blocks = [fused_layer(m.block, m.kv_layer, self.rotary_emb) for m in self.mtp_modules]
        if all(block is not None for block in blocks):
            for module, block in zip(self.mtp_modules, blocks):
                module.block = block
            dtype = self.mtp_modules[0].enorm.weight.dtype
            self.rope_table = RotaryTable.from_hf(self.rotary_emb, max_positions, dtype)

    def kv_shapes(self) -> list[tuple[int, int]]:
        """(num_kv_heads, head_dim) of each module's KV layer."""
        return [module.kv_shape for module in self.mtp_modules]

    def forward(self, module: int, input_ids: torch.Tensor, hidden: torch.Tensor, attn: AttentionMetadata
                ) -> torch.Tensor:
        """Module ``module`` over N tokens: input_ids [N] (t_{i+1}), hidden [N, H] (h_i) at attn.positions (i)
        -> pre-norm hidden [N, H]."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        position_embeddings = (self.rotary_emb(hidden[None], attn.positions[None]) if self.rope_table is None
                               else self.rope_table(attn.positions))
        return self.mtp_modules[module](embeds, hidden, position_embeddings, attn)

    def compute_logits(self, module: int, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [M, H] -> target-vocabulary logits [M, V] fp32, through the module's own head if any,
        else the target's (tensor parallel: this rank's vocabulary rows, gathered from every rank)."""
        shared_head = self.mtp_modules[module].shared_head
        normed = shared_head["norm"](hidden)
        if "head" in shared_head:
            return shared_head["head"](normed).float()
        logits = self.lm_head(normed)
        if self.parallel is not None:
            logits = gather_vocab(logits, self.vocab_size, self.parallel)
        return logits.float()

    def feedback(self, module: int, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden handed on from ``module``'s pre-norm output [N, H]."""
        return self.mtp_modules[module].shared_head["norm"](hidden) if self.feed_post_norm else hidden


def check_dense_target(config: PretrainedConfig, norm_cls: type[nn.Module]) -> None:
    """Refuse targets whose MTP blocks this module cannot build correctly."""
    if getattr(config, "kv_lora_rank", None):
        raise NotImplementedError(f"{config.model_type}: MLA attention (kv_lora_rank) MTP blocks are not supported "
                                  "yet (a later issue)")
    probe = norm_cls(4, eps=1e-6)
    with torch.no_grad():
        probe.weight.zero_()
        if probe(torch.ones(1, 4)).abs().sum() > 0:
            raise NotImplementedError(f"{norm_cls.__name__} computes x̂·(1+w); MTP modules need an x̂·w RMSNorm "
                                      "target")


def check_dense_block(module: MTPModule) -> None:
    """Draft training starts a block from the target's last layer and has only been built for dense blocks; MoE
    MTP modules load for inference (:meth:`MTPDraftModel.from_checkpoint`) but are not trained."""
    if any("experts" in name for name, _ in module.block.named_modules()):
        raise NotImplementedError(f"{type(module.block).__name__} at layer {module.kv_layer} is a MoE block; "
                                  "training MoE MTP modules is not supported")


def decoder_classes(config: PretrainedConfig) -> tuple[type[nn.Module], type[nn.Module]]:
    """(decoder-layer class, RMSNorm class) of the causal LM ``config`` describes (built on the meta device)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    decoder = model.get_decoder()
    return type(decoder.layers[0]), type(decoder.norm)


def random_mtp_modules(config: PretrainedConfig, num_modules: int, seed: int = 0, scale: float = 1.0,
                       own_head: bool = False, dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu") -> list[dict[str, torch.Tensor]]:
    """Canonical weights of ``num_modules`` random MTP modules for a ``config`` target, drawn on ``device`` in
    ``dtype`` (a GLM-4.5-Air MoE module is 4.7 GB in bf16; only the shapes of a meta-device module are used):
    matrices (MoE experts' [E, out, in] too, and the router) N(0, (0.5 / sqrt(fan_in))^2) times ``scale`` (> 1
    sharpens attention), fan_in the last dim; norms 1 + N(0, 0.1^2); biases N(0, 0.02^2), a router's
    ``e_score_correction_bias`` too (enough to change the chosen experts of about 1 token in 10); ``own_head``
    adds a random ``shared_head.head`` per module. One seed draws the same weights on every device of a kind."""
    layer_cls, norm_cls = decoder_classes(config)
    g = torch.Generator(device).manual_seed(seed)
    states = []
    for i in range(num_modules):
        with torch.device("meta"):
            module = MTPModule(config, layer_cls, norm_cls, config.num_hidden_layers + i,
                               config.vocab_size if own_head else None)
        state = {}
        for key, value in module.canonical_state().items():
            noise = torch.randn(value.shape, generator=g, device=device, dtype=dtype)
            if value.dim() >= 2:
                state[key] = noise.mul_(0.5 * scale / value.shape[-1] ** 0.5)
            else:
                state[key] = noise.mul_(0.1).add_(1.0) if key.endswith("norm.weight") else noise.mul_(0.02)
        states.append(state)
    return states


def save_random_mtp_weights(target_dir: str | Path, num_modules: int, layout: str, seed: int = 0,
                            scale: float = 1.0, own_head: bool = False) -> list[dict[str, torch.Tensor]]:
    """Append random MTP modules (``layout``) to a saved target checkpoint; returns their canonical weights."""
    states = random_mtp_modules(AutoConfig.from_pretrained(target_dir), num_modules, seed, scale, own_head)
    if layout == "qwen3_next":  # fc and the three norms are shared by all modules in this layout
        states = [{**s, **{k: states[0][k] for k in OWN_KEYS}} for s in states]
    save_mtp_weights(target_dir, states, layout)
    return states


def _allocate(module: MTPModule, dtype: torch.dtype, keep_fp32: set[str], device: torch.device) -> MTPModule:
    """A meta-device ``module``'s storage on ``device``, uninitialised (the checkpoint fills it): floating tensors
    in ``dtype``, except at 16-bit dtypes those the target's class keeps in fp32 (``keep_fp32``: its
    ``_keep_in_fp32_modules_strict`` name fragments, GLM's router ``gate.weight`` and ``e_score_correction_bias``),
    which stay as read, as transformers loads the target's own layers."""
    computed = [name for m in module.modules() for name in m._non_persistent_buffers_set
                if m._buffers[name] is not None]
    if computed:  # no checkpoint holds them, and to_empty would leave them uninitialised
        raise NotImplementedError(f"{type(module.block).__name__}: MTP blocks with computed buffers {computed}")
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        keep = dtype in (torch.float16, torch.bfloat16) and any(fragment in name for fragment in keep_fp32)
        if tensor.is_floating_point():
            tensor.data = tensor.data.to(torch.float32 if keep else dtype)
    return module.to_empty(device=device)


def _without_copied_head(state: dict[str, torch.Tensor], lm_head_weight: torch.Tensor, vocab_size: int,
                         parallel: TensorParallel | None, name: str) -> dict[str, torch.Tensor]:
    """``state`` without its ``shared_head.head`` [V, H] when that is a copy of the target's lm_head (no second copy
    in memory); a head of another shape is refused naming the tensor (``name``). Tensor parallel:
    ``lm_head_weight`` holds this rank's rows (zero padding past ``vocab_size``), compared with the head's same
    rows; the head counts as a copy only where it is one on every rank (one decision everywhere: a dropped head
    makes the draft's logits a collective gather)."""
    head = state.get(HEAD_KEY)
    if head is None:
        return state
    expected = [vocab_size, lm_head_weight.shape[1]]
    if list(head.shape) != expected:
        raise ValueError(f"{name}: expected shape {expected} (the target's lm_head), found {list(head.shape)}")
    start = 0 if parallel is None else parallel.rank * lm_head_weight.shape[0]
    rows = head[start:start + lm_head_weight.shape[0]]
    copied = torch.equal(rows.to(lm_head_weight.device, lm_head_weight.dtype), lm_head_weight[:len(rows)].detach())
    if parallel is not None:
        copied = all_ranks_agree(copied, parallel, lm_head_weight.device)
    return {k: v for k, v in state.items() if k != HEAD_KEY} if copied else state


def _block_config(config: PretrainedConfig, kv_layer: int) -> PretrainedConfig:
    """The target config, with per-layer fields (``layer_types``) extended to index ``kv_layer`` as full attention."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None or kv_layer < len(layer_types):
        return config
    config = copy.deepcopy(config)
    config.layer_types = list(layer_types) + ["full_attention"] * (kv_layer + 1 - len(layer_types))
    return config


def _module_key(key: str) -> str:
    return key if key.split(".")[0] in _OWN_PREFIXES else f"block.{key}"
