"""The roofline byte count of a generation step (a MoE target's with its measured distinct experts; MTP modules'
per pass, a MoE block's with the experts of each pass), the draft-length sweep's arithmetic, MoE points on the
CPU and the CLI's MoE shapes and --mtp (the benchmark itself runs on a GPU; no timing is asserted)."""
import sys

import pytest
import torch

from tllm_spec.sampling.forcing import ENV_VAR
from tllm_spec.spec_model import SpecModel
from tllm_spec.tools.benchmark import (
    Point,
    best_schedule,
    eager_steps,
    expected_accepted_drafts,
    mtp_passes,
    run_point,
    spec_kind,
    step_bytes,
    to_rows,
)
from tllm_spec.tools.random_models import random_spec_model
from tllm_spec.tools.routing import Routing, moe_layers, routing_of

from ..models import eagle3, tiny_pair



def ids(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32)  # [N, k] expert ids


def test_step_bytes_counts_weights_once_draft_per_pass_and_kv():
    target, head = tiny_pair("llama")
    spec = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=2)
    plain = SpecModel.from_pretrained(target, None, max_batch_size=2)
    cfg = plain.target.config  # 8 layers, hidden 64, 2 KV heads x 16, vocab 97, untied, fp32
    target_weights = sum(p.numel() for p in plain.target.hf.parameters()) - 97 * 64
    kv_per_token = cfg.num_hidden_layers * 2 * 2 * 16
    assert step_bytes(plain, batch=2, context_len=10) == 4 * (target_weights + 2 * 10 * kv_per_token)
    draft = spec.worker.draft_model
    fc = draft.fc.weight.numel()
    per_pass = sum(p.numel() for n, p in draft.named_parameters() if not n.startswith(("fc.", "embed_tokens.")))
    expected = target_weights + 2 * 10 * kv_per_token + fc + 3 * per_pass + 3 * 2 * 10 * (2 * 2 * 16)
    assert step_bytes(spec, batch=2, context_len=10) == 4 * expected

    assert step_bytes(spec, batch=2, context_len=10, draft_len=1) == 4 * (expected - 2 * per_pass
                                                                          - 2 * 2 * 10 * (2 * 2 * 16))
    layer = sum(p.numel() for p in draft.midlayer.parameters())
    assert step_bytes(spec, batch=2, context_len=10, draft_len=0) == 4 * (expected - 3 * per_pass + layer
                                                                          - 2 * 2 * 10 * (2 * 2 * 16))


def test_step_bytes_of_a_tree_step_count_a_head_pass_per_depth():
    """A tree of 5 drafts, 2 deep, reads what a chain of its depth reads (the tree's rows share one read of the
    weights and of the context's K/V); a schedule's chain step of 1 draft reads a chain's."""
    target, head = tiny_pair("llama")
    chain = SpecModel.from_pretrained(target, eagle3(head, 2), max_batch_size=2)
    tree = SpecModel.from_pretrained(target, eagle3(head, 2).model_copy(update={
        "eagle_choices": [[0], [1], [2], [0, 0], [1, 0]]}), max_batch_size=2)
    assert tree.max_draft_len == 5
    assert step_bytes(tree, batch=2, context_len=10) == step_bytes(chain, batch=2, context_len=10)
    assert step_bytes(tree, batch=2, context_len=10, draft_len=1) == step_bytes(chain, batch=2, context_len=10,
                                                                                draft_len=1)


def test_expected_accepted_drafts_of_a_chain():
    assert expected_accepted_drafts(0, 0.7) == 0
    assert expected_accepted_drafts(3, 0.7) == pytest.approx(0.7 + 0.49 + 0.343)
    assert expected_accepted_drafts(3, 1.0) == 3


def point(batch, draft_len, tps):
    return Point("eagle3", batch, draft_len, None, 1.0, 0.0, 1.0, tps, 1.0, 1.0, 1.0, 0.0)


def test_best_schedule_keeps_the_fastest_length_per_batch_and_merges_repeats():
    points = [point(1, 0, 100), point(1, 3, 300), point(4, 3, 900), point(4, 2, 800),
              point(16, 2, 2000), point(16, 3, 1900), point(64, 2, 5000), point(64, 0, 6000)]
    assert best_schedule(points) == {1: 3, 16: 2, 64: 0}


def test_step_bytes_of_a_moe_target_reads_each_layers_distinct_experts_once(tmp_path):
    """Non-expert weights (attention, routers, norms, shared experts, the dense first layer, lm_head) once, plus per
    MoE layer the distinct experts of the step: 3 on average here (2 in one step, 4 in the other), not all 8
    and not top-2 x 4 tokens."""
    model = random_spec_model("tiny-glm4-moe", "none", 0, tmp_path, torch.float32, "cpu", max_batch_size=2)
    hf, cfg = model.target.hf, model.target.config  # 8 layers (7 MoE), hidden 64, 2 KV heads x 16, fp32
    non_expert = sum(p.numel() for n, p in hf.named_parameters() if ".experts." not in n and "embed" not in n)
    expert_bytes = 4 * (2 * 32 * 64 + 64 * 32)  # gate_up [2I, H] + down [H, I] of one expert
    logs = [[ids([0, 1], [1, 0]), ids([0, 1], [2, 3])] for _ in range(7)]
    routing = routing_of(moe_layers(model.target), logs, max_rows=2)
    kv = 2 * 10 * cfg.num_hidden_layers * 2 * 2 * 16 * 4
    assert step_bytes(model, batch=2, context_len=10, routing=routing) == 4 * non_expert + 7 * 3 * expert_bytes + kv
    with pytest.raises(ValueError, match="7 MoE layers"):
        step_bytes(model, batch=2, context_len=10)


def test_run_point_of_a_moe_target_counts_the_experts_its_steps_read(tmp_path, monkeypatch):
    """Every GLM router made to pick experts 3 and 5 (zero logits, a correction bias on those two): each decoding
    step reads two experts per MoE layer whatever its tokens, and the point's roofline counts those."""
    monkeypatch.setenv(ENV_VAR, "")  # run_point forces acceptance: the environment is restored after the test
    model = random_spec_model("tiny-glm4-moe", "eagle3", 3, tmp_path, torch.float32, "cpu", max_batch_size=2)
    for layer in moe_layers(model.target):
        layer.module.router.weight.data.zero_()
        layer.module.router.e_score_correction_bias.copy_(torch.eye(8)[3] + torch.eye(8)[5])
    p = run_point(model, batch=2, prompt_len=8, new_tokens=16, forced=3.0, bandwidth=1e12)
    assert p.distinct_experts_per_layer == 2.0 and p.routing_steps == 4  # 15 tokens after the prompt's, 4 a step
    assert p.routing_same_tokens
    assert p.expert_bytes_per_step == 7 * 2 * 4 * (2 * 32 * 64 + 64 * 32)
    routing = Routing((2.0,) * 7, (4 * (2 * 32 * 64 + 64 * 32),) * 7, 4)
    assert p.roofline_bytes_per_step == step_bytes(model, 2, 8 + 16 / 2, 3, routing)
    assert p.path == "tllm_spec engine, fused layers, fused MoE, eager steps"
    assert to_rows([p])[0]["distinct_experts_per_layer"] == 2.0


def test_eager_steps_set_the_graphs_aside_and_give_them_back():
    target, _ = tiny_pair("llama")
    model = SpecModel.from_pretrained(target, None, max_batch_size=2)
    graphs = model.runner.graph_runner = object()  # as a CUDA model holds its graph runner
    with eager_steps(model):
        assert model.runner.graph_runner is None
    assert model.runner.graph_runner is graphs




@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "glm-4.5-air", "mixtral-8x7b", "tiny-qwen3-moe"])
def test_the_cli_takes_the_moe_shapes(script, monkeypatch, shape):
    monkeypatch.setattr(sys, "argv", ["benchmark.py", "--shape", shape, "--hf-experts", "eager"])
    args = script.parse_args()
    assert args.shape == shape and args.hf_experts == ["eager"]
    monkeypatch.setattr(sys, "argv", ["benchmark.py", "--shape", shape])
    assert script.parse_args().hf_experts == ["eager", "grouped_mm"]
    for refused in (["--draft-shape", shape],  # a draft LM is a dense model
                    ["--shape", shape, "--context", "2048"]):  # the long-context run builds dense targets only
        monkeypatch.setattr(sys, "argv", ["benchmark.py", *refused])
        with pytest.raises(SystemExit):
            script.parse_args()


def test_the_table_of_a_moe_run_shows_experts_per_layer_and_failed_hf_runs(script):
    row = {**to_rows([point(1, 3, 100.0)])[0], "distinct_experts_per_layer": 17.25}
    results = {"gpu": "H100", "shape": "qwen3-30b-a3b", "k": 3, "prompt_len": 128, "new_tokens": 128,
               "date": "today", "bandwidth_bytes_per_s": {"gemv": 3e12}, "points": [row],
               "moe": {"num_moe_layers": 48, "num_experts": 128, "top_k": 8},
               "hf": [{"batch": 1, "static_cache": False, "experts_implementation": "eager", "tokens_per_second": 9.0},
                      {"batch": 1, "static_cache": True, "experts_implementation": "eager", "error": "boom"}]}
    lines = script.table(results).splitlines()
    assert "48 MoE layers of 128 experts, top-8" in lines[1] and lines[2].endswith("| experts/layer |")
    assert lines[4].endswith("| 17.2 |")
    assert "HF generate experts=eager | - | 1 | - | 1 | - | 9.0 |" in lines[5]
    assert "(static cache) experts=eager" in lines[6] and "| failed |" in lines[6]


def test_step_bytes_of_mtp_eagle_count_the_module_and_lm_head_per_pass(tmp_path):
    """One random MTP module on a random target built without a checkpoint: each of the K passes reads the module
    (block, eh_proj, norms) and its KV layer, each draft the target's lm_head again; K = 0 keeps the one pass that
    writes the module's KV, without a draft."""
    model = random_spec_model("tiny", "mtp", 3, tmp_path, torch.float32, "cpu", max_batch_size=2)
    assert spec_kind(model) == "mtp" and model.target.checkpoint_dir is None
    plain = SpecModel.from_target(model.target, None, max_batch_size=2)
    module = 4 * sum(p.numel() for p in model.worker.draft_model.mtp_modules[0].parameters())
    lm_head, kv = 4 * 32000 * 64, 2 * 10 * (2 * 2 * 16 * 4)  # vocab 32000 (Llama's), 2 KV heads x 16, batch 2
    base = step_bytes(plain, batch=2, context_len=10)
    assert step_bytes(model, batch=2, context_len=10) == base + 3 * (module + lm_head + kv)
    assert step_bytes(model, batch=2, context_len=10, draft_len=1) == base + module + lm_head + kv
    assert step_bytes(model, batch=2, context_len=10, draft_len=0) == base + module + kv


def test_step_bytes_of_vanilla_mtp_and_per_step_selection():
    """Vanilla MTP: every module once over its window, a draft (an lm_head read) each. Per-step selection, 2 modules,
    K = 3 (modules 0 1 0): pass s runs the modules used at step s or later, so module 0 three times, module 1 twice."""
    from tllm_spec import MTPConfig

    from ..test_mtp_lossless import mtp_target

    target = mtp_target("llama", "deepseek")
    plain = SpecModel.from_pretrained(target, None, max_batch_size=2)
    base, lm_head, kv = step_bytes(plain, 2, 10), 4 * 97 * 64, 2 * 10 * (2 * 2 * 16 * 4)
    vanilla = SpecModel.from_pretrained(target, MTPConfig(num_nextn_predict_layers=3, use_mtp_vanilla=True),
                                        max_batch_size=2)
    modules = [4 * sum(p.numel() for p in m.parameters()) for m in vanilla.worker.draft_model.mtp_modules]
    assert step_bytes(vanilla, 2, 10) == base + sum(modules) + 3 * (lm_head + kv)
    per_step = SpecModel.from_pretrained(target, MTPConfig(num_nextn_predict_layers=2, max_draft_len=3,
                                                           mtp_layer_selection="per_step"), max_batch_size=2)
    assert mtp_passes(per_step.worker, 3) == ([(0, 1), (0, 1), (0,)], [0, 1, 0])
    assert mtp_passes(per_step.worker, 0) == ([(0, 1)], [])
    assert step_bytes(per_step, 2, 10) == base + 3 * modules[0] + 2 * modules[1] + 3 * lm_head + 5 * kv
    assert mtp_passes(vanilla.worker, 3) == ([(0,), (1,), (2,)], [0, 1, 2])


def test_run_point_of_a_moe_mtp_module_counts_the_experts_of_each_pass(tmp_path, monkeypatch):
    """GLM-4.5's MoE MTP block, every router (the target's and the block's) made to pick experts 3 and 5: each of
    the K = 3 passes reads those two, so a decoding step's draft reads 6 experts, besides the block's other weights
    per pass and the lm_head per draft."""
    monkeypatch.setenv(ENV_VAR, "")
    model = random_spec_model("tiny-glm4-moe", "mtp", 3, tmp_path, torch.float32, "cpu", max_batch_size=2)
    draft = model.worker.draft_model
    for layer in moe_layers(model.target) + moe_layers(draft):
        layer.module.router.weight.data.zero_()
        layer.module.router.e_score_correction_bias.copy_(torch.eye(8)[3] + torch.eye(8)[5])
    p = run_point(model, batch=2, prompt_len=8, new_tokens=16, forced=3.0, bandwidth=1e12)
    expert_bytes = 4 * (2 * 32 * 64 + 64 * 32)
    assert p.mode == "mtp" and p.distinct_experts_per_layer == 2.0 and p.routing_steps == 4
    assert p.draft_experts_per_step == 6.0 and p.draft_expert_bytes_per_step == 6 * expert_bytes
    routing = Routing((2.0,) * 7, (expert_bytes,) * 7, 4, (6.0,), (expert_bytes,))
    assert p.roofline_bytes_per_step == step_bytes(model, 2, 8 + 16 / 2, 3, routing)
    module = draft.mtp_modules[0]
    non_expert = 4 * sum(p.numel() for n, p in module.named_parameters() if not n.endswith(("mlp.gate_up", "mlp.down")))
    # q/k/v with biases (64 + 2 x 32 rows), o, 5 norms, eh_proj [64, 128], the router [8, 64], the shared expert
    assert non_expert == 4 * (128 * 65 + 64 * 64 + 5 * 64 + 64 * 128 + 8 * 64 + 3 * 32 * 64)
    plain_routing = Routing((2.0,) * 7, (expert_bytes,) * 7, 4)
    with pytest.raises(ValueError, match="1 MoE blocks"):
        step_bytes(model, 2, 16, 3, plain_routing)
    plain = SpecModel.from_target(model.target, None, max_batch_size=2)
    kv, lm_head = 16 * 2 * (2 * 2 * 16 * 4), 4 * 256 * 64
    assert step_bytes(model, 2, 16, 3, routing) == (step_bytes(plain, 2, 16, 0, plain_routing) + 6 * expert_bytes
                                                    + 3 * (non_expert + lm_head + kv))


@pytest.mark.parametrize("flags", [["--mtp", "--sa"], ["--mtp", "--tree"], ["--mtp", "--draft-shape", "tiny"]])
def test_the_cli_takes_mtp_on_any_shape_and_alone(script, monkeypatch, flags):
    for shape in ("glm-4.5-air", "llama-3.1-8b"):
        monkeypatch.setattr(sys, "argv", ["benchmark.py", "--shape", shape, "--mtp", "-k", "2"])
        args = script.parse_args()
        assert script.spec_of(args) == ("mtp", {}) and args.max_draft_len == 2
    monkeypatch.setattr(sys, "argv", ["benchmark.py", *flags])
    with pytest.raises(SystemExit):
        script.parse_args()
