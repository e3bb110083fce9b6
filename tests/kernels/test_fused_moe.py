"""fused_moe's torch reference against a per-token loop and Hugging Face's stock expert modules, the custom op's
registration, and moe_align_ref's invariants. (The Triton kernels against these references run under the
interpreter: tests/kernels/interpreted.py.)"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from tllm_spec.kernels.fused_moe import fused_moe_op, fused_moe_ref
from tllm_spec.kernels.moe_align import max_padded_pairs, moe_align_ref


def _operands(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
              seed: int = 0) -> tuple[torch.Tensor, ...]:
    """x [N, H], gate_up [E, 2I, H], down [E, H, I] in dtype; weights [N, k] fp32; ids [N, k] int32, k distinct
    experts a token as a router's top-k chooses them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden ** -0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, generator=g) * inter ** -0.5).to(dtype)
    weights = torch.rand(num_tokens, top_k, generator=g)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)]
                      or [torch.zeros(0, top_k, dtype=torch.long)])
    return x, gate_up, down, weights, ids.view(num_tokens, top_k).int()


def _per_token(x, gate_up, down, weights, ids) -> torch.Tensor:
    """The semantics one token and one expert at a time: out[n] = sum_j w[n, j] * down[e] @ (silu(g) * u), each
    product rounded to x's dtype, the weighted sum in fp32."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for n in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[n, j])
            gate, up = F.linear(x[n], gate_up[e]).chunk(2)
            out[n] += F.linear(F.silu(gate) * up, down[e]).float() * weights[n, j]
    return out.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,top_k,num_experts", [(1, 1, 4), (3, 2, 8), (17, 8, 16), (40, 2, 3)])
def test_reference_is_the_per_token_loop(num_tokens, top_k, num_experts, dtype):
    ops = _operands(num_tokens, top_k, num_experts, 24, 20, dtype, seed=num_tokens)
    out = fused_moe_ref(*ops)
    assert out.dtype == dtype and out.shape == (num_tokens, 24)
    # fp32: sums in another order; bf16: each rounding where the loop rounds, so at most the last ulp differs
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-6, "rtol": 2 ** -8}
    torch.testing.assert_close(out, _per_token(*ops), **tol)


def _hf_experts(family: str, gate_up: torch.Tensor, down: torch.Tensor) -> torch.nn.Module:
    """The stock expert module of ``family`` holding these weights (its eager expert loop)."""
    num_experts, two_inter, hidden = gate_up.shape
    if family == "qwen3_moe":
        config = Qwen3MoeConfig(num_experts=num_experts, hidden_size=hidden, moe_intermediate_size=two_inter // 2)
        experts = Qwen3MoeExperts(config)
    else:
        config = MixtralConfig(num_local_experts=num_experts, hidden_size=hidden, intermediate_size=two_inter // 2)
        experts = MixtralExperts(config)
    config._experts_implementation = "eager"
    assert experts.gate_up_proj.shape == gate_up.shape and experts.down_proj.shape == down.shape
    experts.gate_up_proj.data, experts.down_proj.data = gate_up, down
    return experts


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_stock_expert_loop(family, dtype):
    x, gate_up, down, weights, ids = _operands(13, 2 if family == "mixtral" else 4, 8, 32, 24, dtype, seed=3)
    weights = weights.to(dtype).float()  # weights as a router rounds them to the model dtype
    with torch.no_grad():
        stock = _hf_experts(family, gate_up, down)(x, ids.long(), weights.to(dtype))
    out = fused_moe_ref(x, gate_up, down, weights, ids)
    if dtype == torch.float32:
        torch.testing.assert_close(out, stock, atol=1e-5, rtol=1e-5)
    else:  # the stock loop rounds each weighted product and each partial sum to bf16; here the sum is fp32
        torch.testing.assert_close(out, stock, atol=1e-2, rtol=2 ** -6)


def test_reference_without_tokens_and_with_ids_outside_the_experts():
    x, gate_up, down, weights, ids = _operands(0, 2, 4, 16, 8, torch.float32)
    assert fused_moe_ref(x, gate_up, down, weights, ids).shape == (0, 16)
    x, gate_up, down, weights, ids = _operands(5, 2, 4, 16, 8, torch.float32)
    outside = ids.clone()
    outside[:, 1] = torch.tensor([-1, 4, 4, 7, -3])  # another rank's experts: nothing
    only_first = fused_moe_ref(x, gate_up, down, weights[:, :1], ids[:, :1])
    torch.testing.assert_close(fused_moe_ref(x, gate_up, down, weights, outside), only_first)


def test_custom_op_matches_its_fake():
    ops = _operands(6, 2, 4, 16, 8, torch.float32)
    torch.library.opcheck(fused_moe_op, ops)
    torch.testing.assert_close(torch.ops.tllm_spec.fused_moe(*ops), fused_moe_ref(*ops))


def _ids(num_tokens: int, top_k: int, num_experts: int, kind: str, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(num_tokens * 13 + top_k + num_experts)
    ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=g)
    if kind == "skewed":  # one expert takes most pairs (many blocks), the upper half of the experts none
        ids = torch.where(torch.rand(num_tokens, top_k, generator=g) < 0.7, 1, ids % max(1, num_experts // 2))
    if kind == "outside":  # ids of no expert here are left out
        ids[::3, 0] = num_experts
        ids[1::4, -1] = -1
    return ids.to(dtype)


@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m,kind", [
    (0, 2, 8, 16, "uniform"), (1, 1, 8, 16, "uniform"), (1, 8, 64, 16, "uniform"), (3, 2, 8, 4, "uniform"),
    (17, 8, 64, 16, "skewed"), (111, 2, 8, 32, "skewed"), (200, 1, 8, 64, "uniform"), (40, 4, 16, 16, "outside")])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_moe_align_ref_invariants(num_tokens, top_k, num_experts, block_m, kind, dtype):
    ids = _ids(num_tokens, top_k, num_experts, kind, dtype)
    sorted_pair_ids, block_expert, num_padded = moe_align_ref(ids, num_experts, block_m)
    num_pairs, max_padded = ids.numel(), max_padded_pairs(ids.numel(), num_experts, block_m)
    assert sorted_pair_ids.shape == (max_padded,) and block_expert.shape == (max_padded // block_m,)
    assert num_padded.shape == (1,) and {t.dtype for t in (sorted_pair_ids, block_expert, num_padded)} == {torch.int32}
    flat = ids.flatten().long()
    inside = (flat >= 0) & (flat < num_experts)
    counts = torch.bincount(flat[inside], minlength=num_experts)
    padded = int(((counts + block_m - 1) // block_m * block_m).sum())
    assert int(num_padded) == padded <= max_padded
    real = sorted_pair_ids[sorted_pair_ids != num_pairs]
    assert sorted(real.tolist()) == inside.nonzero().flatten().tolist()  # every pair of an expert, exactly once
    assert (sorted_pair_ids[padded:] == num_pairs).all() and (block_expert[padded // block_m:] == -1).all()
    experts_in_order = block_expert[:padded // block_m]
    assert (experts_in_order[1:] >= experts_in_order[:-1]).all()
    for b, block in enumerate(sorted_pair_ids[:padded].view(-1, block_m).tolist()):
        pairs = [p for p in block if p != num_pairs]
        assert pairs and block[:len(pairs)] == pairs  # a block starts with its pairs, padding after
        assert pairs == sorted(pairs)  # stable: in pair order within an expert
        assert all(flat[p] == block_expert[b] for p in pairs)  # one expert a block
