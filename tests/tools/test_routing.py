"""Counting the experts a MoE target's steps read: distinct experts per layer per decoding step from hand-made
routing logs, and the logs of real runs through the fused MoE layers and through the stock HF blocks; a MoE MTP
block's passes, each a forward reading its own experts."""
from __future__ import annotations

import pytest
import torch

from tllm_spec.config import SamplingParams
from tllm_spec.model.moe import MoE
from tllm_spec.model.target import TargetModel
from tllm_spec.spec_model import SpecModel
from tllm_spec.tools.benchmark import measure_routing
from tllm_spec.tools.random_models import shape_config
from tllm_spec.tools.routing import (
    PassLog,
    distinct_experts,
    draft_experts,
    moe_layers,
    routing_logs,
    routing_of,
)


def ids(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32)  # [N, k] expert ids of N tokens


def test_distinct_experts_count_an_expert_once_per_step_and_leave_out_prompt_steps():
    """Two layers, top-2 of 8 experts, batch 2 with one draft each (4 rows a decoding step)."""
    layer0 = [ids(*[[0, 1]] * 6),  # a prompt step of 6 tokens: left out
              ids([0, 1], [1, 0], [0, 1], [1, 0]),  # 4 tokens, 8 routings, 2 experts
              ids([0, 1], [2, 3], [4, 5], [6, 7]),  # every expert
              ids([3, 3], [3, 3])]  # a shorter last step: one expert
    layer1 = [ids(*[[2, 3]] * 6), ids([5, 6], [6, 5], [5, 7], [7, 6]), ids([0, 1], [0, 2], [0, 3], [0, 4]),
              ids([1, 2], [2, 1])]
    counts = distinct_experts([layer0, layer1], [8, 8], max_rows=4)
    assert counts.tolist() == [[2, 3], [8, 5], [1, 2]]
    layers = [type("Layer", (), {"num_experts": 8, "expert_bytes": eb})() for eb in (100, 1000)]
    routing = routing_of(layers, [layer0, layer1], max_rows=4)
    assert routing.distinct_per_layer == (11 / 3, 10 / 3) and routing.num_steps == 3
    assert routing.mean_distinct == pytest.approx(3.5)
    assert routing.bytes_per_step == pytest.approx(11 / 3 * 100 + 10 / 3 * 1000)
    with pytest.raises(ValueError, match="no decoding step"):
        routing_of(layers, [layer0[:1], layer1[:1]], max_rows=4)
    with pytest.raises(ValueError, match="different numbers of forwards"):
        distinct_experts([layer0, layer1[:2]], [8, 8], max_rows=4)


def tiny_moe_target() -> TargetModel:
    return TargetModel.from_config(shape_config("tiny-qwen3-moe"), torch.float32, "cpu", seed=0)


def run_logged(model: SpecModel, prompts: list[list[int]]) -> tuple[list, list[list[torch.Tensor]]]:
    layers = moe_layers(model.target)
    with routing_logs(layers) as logs:
        model.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
    return layers, logs


def test_fused_moe_layers_and_stock_blocks_log_the_same_routing():
    """The fused path logs through MoE.routing_log, the stock HF blocks through a hook on their router: one entry
    per forward and layer, the prompt step's 2 x 5 rows then one row per request; the same experts either way."""
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7, 6, 5]]
    fused = SpecModel.from_target(tiny_moe_target(), None, max_batch_size=2)
    layers, logs = run_logged(fused, prompts)
    assert len(layers) == 8 and all(isinstance(layer.module, MoE) for layer in layers)
    assert [len(log) for log in logs] == [4] * 8 and [e.shape for e in logs[0]] == [(10, 2)] + [(2, 2)] * 3
    assert all(layer.module.routing_log is None for layer in layers)  # logging stops with the block
    stock = SpecModel.from_target(tiny_moe_target(), None, max_batch_size=2, use_fused_layers=False)  # same seed
    stock_layers, stock_logs = run_logged(stock, prompts)
    assert [type(layer.module).__name__ for layer in stock_layers] == ["Qwen3MoeSparseMoeBlock"] * 8
    assert stock_layers[0].expert_bytes == layers[0].expert_bytes == 4 * 3 * 32 * 64
    for log, stock_log in zip(logs, stock_logs):
        assert all(torch.equal(a.sort(-1).values.int(), b.sort(-1).values.int()) for a, b in zip(log, stock_log))
    assert not stock_layers[0].module.gate._forward_hooks  # the hooks are removed
    with routing_logs(layers), pytest.raises(RuntimeError, match="already"), routing_logs(layers):
        pass  # a second log of the same layers is refused


def test_measure_routing_keeps_the_decoding_steps():
    model = SpecModel.from_target(tiny_moe_target(), None, max_batch_size=2)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7, 6, 5]]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    routing, tokens = measure_routing(model, prompts, params, seed=0, max_rows=2)
    assert tokens == [o.token_ids for o in model.generate(prompts, params, seed=0)]
    assert routing.num_steps == 5 and len(routing.distinct_per_layer) == 8  # the prompt step made the first token
    assert all(1 <= d <= 4 for d in routing.distinct_per_layer)  # 2 tokens x top-2: 2 to 4 experts
    dense = SpecModel.from_target(TargetModel.from_config(shape_config("tiny"), torch.float32, "cpu"), None)
    assert measure_routing(dense, prompts, SamplingParams(max_new_tokens=2), seed=0, max_rows=2) is None


def test_draft_passes_read_each_passes_distinct_experts_summed_over_the_step():
    """An MTP block's passes are forwards of their own: a step reads each one's distinct experts. The passes are
    told apart by the target forwards logged before them (PassLog.steps); those after a prompt step are left out."""
    target_log: list[torch.Tensor] = []
    draft_log = PassLog(target_log)
    target_log.append(ids(*[[0, 1]] * 6))  # a prompt step: its first draft pass and a one-token pass, left out
    draft_log.append(ids(*[[0, 1]] * 6))
    draft_log.append(ids([2, 3], [4, 5]))
    target_log.append(ids([0, 1], [2, 3], [4, 5], [6, 7]))
    draft_log.append(ids([0, 1], [1, 0], [0, 1], [1, 0]))  # the step's 4 rows: 2 experts
    draft_log.append(ids([0, 1], [2, 3]))  # one token per request: 4 experts, experts 0 and 1 read again
    target_log.append(ids([0, 1], [1, 0], [0, 1], [1, 0]))
    draft_log.append(ids([7, 6], [6, 7], [7, 6], [6, 7]))  # 2
    draft_log.append(ids([7, 6], [5, 7]))  # 3
    assert draft_log.steps == [1, 1, 2, 2, 3, 3]
    assert draft_experts([draft_log], [8], target_log, max_rows=4).tolist() == [[6], [5]]
    layers = [type("Layer", (), {"num_experts": 8, "expert_bytes": 100})()]
    draft_layers = [type("Layer", (), {"num_experts": 8, "expert_bytes": 10})()]
    routing = routing_of(layers, [target_log, draft_log], max_rows=4, draft_layers=draft_layers)
    assert routing.distinct_per_layer == (5.0,) and routing.num_steps == 2  # (8 + 2) / 2: the target counts as before
    assert routing.draft_experts_per_layer == (5.5,) and routing.draft_bytes_per_step == pytest.approx(55.0)
    assert routing_of(layers, [target_log], max_rows=4).draft_bytes_per_step == 0.0  # no draft layers


def test_the_mtp_blocks_passes_are_logged_after_the_targets_layers(tmp_path):
    """GLM-4.5's MoE MTP block, MTP-Eagle with 2 drafts: per step one pass over the step's 3 rows a request, then one
    over 1 row a request, each tagged with its step."""
    from tllm_spec.tools.random_models import random_spec_model

    model = random_spec_model("tiny-glm4-moe", "mtp", 2, tmp_path, torch.float32, "cpu", max_batch_size=2)
    layers, draft_layers = moe_layers(model.target), moe_layers(model.worker.draft_model)
    assert len(layers) == 7 and len(draft_layers) == 1 and isinstance(draft_layers[0].module, MoE)
    with routing_logs(layers, draft_layers) as logs:
        model.generate([[1, 2, 3, 4, 5], [9, 8, 7]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    draft_log = logs[-1]
    assert draft_log.step_log is logs[0] and draft_log.steps == [s for s in range(1, len(logs[0]) + 1) for _ in "ab"]
    assert [e.shape[0] for e in draft_log][:4] == [8, 2, 6, 2]  # the prompt step's 5 + 3 rows, then 2 x (2 + 1)
    assert draft_layers[0].module.routing_log is None
