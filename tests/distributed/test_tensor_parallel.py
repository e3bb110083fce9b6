"""Tensor parallelism on the CPU: gloo at world size 2 in spawned processes, tiny fp32 targets saved with
save_pretrained and loaded shard by shard through the real loader, an EAGLE-3 head or MTP modules replicated on
each rank."""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import traceback
from functools import cache
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pydantic import ValidationError

from tllm_spec import Eagle3Config, EngineConfig, MTPConfig, SamplingParams
from tllm_spec.distributed.parallel import TensorParallel, check_shardable
from tllm_spec.spec_model import SpecModel
from tllm_spec.tools.random_models import save_random_head, save_random_target, target_config

from ..models import eagle3, hf_greedy

WORLD_SIZE = 2
TIMEOUT_S = 240  # a rank that hangs in a collective fails the test instead of the suite
PROMPTS = [[5, 17, 3, 44, 9, 2, 71], [12, 8], [60, 61, 62, 63, 1, 2, 3, 4, 5, 6, 7, 8, 9]]
MAX_NEW = [14, 9, 17]
# llama: 2 KV heads split over 2 ranks, q/k/v/o and MLP biases (row-parallel biases added once), untied head;
# qwen3: 1 KV head replicated on both ranks, q/k norms, tied embedding; both: vocab 97 (lm_head rows padded).
TARGETS = {"llama": dict(attention_bias=True, mlp_bias=True),
           "qwen3": dict(head_dim=32, num_key_value_heads=1, tie_word_embeddings=True)}


@cache
def tiny_tp_pair(arch: str, **overrides) -> tuple[Path, Path]:
    root = Path(tempfile.mkdtemp(prefix=f"tllm_spec_tp_{arch}_"))
    cfg = target_config(arch, **{**TARGETS.get(arch, {}), **overrides})
    return save_random_target(root / "target", cfg, seed=3), save_random_head(root / "head", cfg, seed=4)


def run_ranks(fn, *args, backend: str = "gloo") -> list:
    """``fn(*args)`` on every rank of a ``backend`` world of WORLD_SIZE spawned processes (nccl: one GPU each);
    returns each rank's result (an exception as ("error", text)). Fails when a rank does not answer within
    TIMEOUT_S."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_file = tempfile.mktemp(prefix="tllm_spec_tp_init_")
    procs = [ctx.Process(target=_rank_main, args=(rank, init_file, backend, fn, args, results))
             for rank in range(WORLD_SIZE)]
    for p in procs:
        p.start()
    answers = {}
    try:
        for _ in procs:
            rank, answer = results.get(timeout=TIMEOUT_S)
            answers[rank] = answer
    except queue.Empty:
        pytest.fail(f"ranks {sorted(set(range(WORLD_SIZE)) - set(answers))} hung for {TIMEOUT_S} s")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [answers[r] for r in range(WORLD_SIZE)]


def assert_no_rank_failed(ranks: list) -> None:
    """Fail with every failed rank's error and the ranks that finished: the first rank to raise is the cause, and
    the others often report only that its connection closed (a rank that finished while another waits in a
    collective means the ranks ran different collectives)."""
    failed = {rank for rank, answer in enumerate(ranks) if isinstance(answer, tuple) and answer[:1] == ("error",)}
    assert not failed, "\n".join([f"rank {rank}: {ranks[rank][1]}" for rank in sorted(failed)]
                                  + [f"ranks that finished: {sorted(set(range(len(ranks))) - failed)}"])


def _rank_main(rank: int, init_file: str, backend: str, fn, args: tuple, results) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)  # as torchrun sets it: the GPU of this rank
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        answer = fn(*args)
    except Exception as err:  # noqa: BLE001 - reported to the test process
        answer = ("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
    results.put((rank, answer))
    dist.destroy_process_group()


def _generate_tp2(target: str, head: str) -> dict[str, list[list[int]]]:
    params = [SamplingParams(max_new_tokens=n, logprobs=None if i else 3) for i, n in enumerate(MAX_NEW)]
    out = {}
    tree = Eagle3Config(speculative_model=head, max_draft_len=3, use_dynamic_tree=True, dynamic_tree_max_topK=2,
                        max_total_draft_tokens=6, use_rejection_sampling=True)
    static = Eagle3Config(speculative_model=head, max_draft_len=2, eagle_choices=[[0], [1], [0, 0], [0, 1], [1, 0]])
    for name, spec in (("eagle3", eagle3(Path(head), 3)), ("plain", None), ("dynamic tree", tree),
                       ("static tree", static)):
        model = SpecModel.from_pretrained(target, spec, max_batch_size=2, tensor_parallel_size=WORLD_SIZE)
        assert model.target.fused is not None and model.target.parallel.size == WORLD_SIZE
        if spec is not None:  # tp_draft="auto": the head split like the target, a chain's and a tree's
            out[f"{name} head split"] = model.worker.draft_model.parallel is not None
        outs = model.generate(PROMPTS, params)
        out[name] = [o.token_ids for o in outs]
        out[f"{name} logprobs"] = [outs[0].logprobs, outs[0].top_logprobs]
    return out


@pytest.mark.slow  # two processes decoding four kinds: twenty seconds or more on the 2-core machine
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tp2_greedy_equals_tp1_and_hf_generate(arch):
    target, head = tiny_tp_pair(arch)
    ranks = run_ranks(_generate_tp2, str(target), str(head))
    assert_no_rank_failed(ranks)
    assert ranks[0] == ranks[1]  # lockstep: the same tokens on every rank
    tp1 = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=2)
    tp1_outs = tp1.generate(PROMPTS, [SamplingParams(max_new_tokens=n, logprobs=3) for n in MAX_NEW])
    hf = [hf_greedy(target, p, n) for p, n in zip(PROMPTS, MAX_NEW)]
    assert [o.token_ids for o in tp1_outs] == hf
    assert ranks[0]["eagle3"] == hf
    assert ranks[0]["plain"] == hf
    assert ranks[0]["dynamic tree"] == hf  # each rank grows the same trees from the gathered logits
    assert ranks[0]["static tree"] == hf
    assert ranks[0]["eagle3 head split"] and ranks[0]["dynamic tree head split"] and ranks[0]["static tree head split"]
    for name in ("eagle3 logprobs", "plain logprobs", "dynamic tree logprobs", "static tree logprobs"):  # the gathered vocabulary's log-softmax, as TP 1's
        logprobs, tops = ranks[0][name]
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(tp1_outs[0].logprobs), atol=1e-4)
        assert [list(top) for top in tops] == [list(top) for top in tp1_outs[0].top_logprobs]


def _eagle3_tp2(target: str, head: str, tp_draft: str) -> dict[str, object]:
    model = SpecModel.from_pretrained(target, eagle3(Path(head), 3), max_batch_size=2,
                                      tensor_parallel_size=WORLD_SIZE, tp_draft=tp_draft)
    outs = model.generate(PROMPTS, [SamplingParams(max_new_tokens=n) for n in MAX_NEW])
    draft = model.worker.draft_model
    return {"tokens": [o.token_ids for o in outs], "accepted": [o.stats.accepted_per_step for o in outs],
            "qkv rows": draft.midlayer.self_attn.qkv_proj.weight.shape[0], "vocab rows": draft.lm_head.weight.shape[0],
            "kv layers": model.runner.kv_cache.k[-1].shape[2]}


@pytest.mark.slow  # two processes loading twice: about twenty seconds on the 2-core machine
def test_tp2_sharded_head_drafts_as_the_whole_head_does():
    """tp_draft="sharded": each rank holds its half of the head's heads, MLP units and draft vocabulary (the
    llama pair: 4 heads and 2 KV heads of 32, a draft vocabulary of 97 padded to 49 rows a rank), and every
    request accepts exactly what the replicated head and TP 1 accept, its tokens HF's greedy ones."""
    target, head = tiny_tp_pair("llama")
    sharded = run_ranks(_eagle3_tp2, str(target), str(head), "sharded")
    whole = run_ranks(_eagle3_tp2, str(target), str(head), "replicated")
    for answer in sharded + whole:
        assert not (isinstance(answer, tuple) and answer[0] == "error"), answer[1]
    assert sharded[0] == sharded[1]
    tp1 = SpecModel.from_pretrained(target, eagle3(head, 3), max_batch_size=2)
    tp1_outs = tp1.generate(PROMPTS, [SamplingParams(max_new_tokens=n) for n in MAX_NEW])
    assert sharded[0]["tokens"] == whole[0]["tokens"] == [hf_greedy(target, p, n) for p, n in zip(PROMPTS, MAX_NEW)]
    assert sharded[0]["accepted"] == whole[0]["accepted"] == [o.stats.accepted_per_step for o in tp1_outs]
    head_cfg = tp1.worker.draft_model.head.llama_config
    full_qkv = (head_cfg.num_attention_heads + 2 * head_cfg.num_key_value_heads) * head_cfg.head_dim
    assert whole[0]["qkv rows"] == full_qkv and sharded[0]["qkv rows"] == full_qkv // WORLD_SIZE
    assert sharded[0]["vocab rows"] == -(-tp1.worker.draft_model.head.draft_vocab_size // WORLD_SIZE)
    assert sharded[0]["kv layers"] * WORLD_SIZE == whole[0]["kv layers"]


def test_tp_draft_sharded_refuses_a_draft_it_cannot_split():
    from tllm_spec.drafts.plain import PlainWorker  # MTP modules and draft LMs inherit the same refusal

    with pytest.raises(ValueError, match="tp_draft='sharded' splits an EAGLE-3 head"):
        PlainWorker().shard_draft(None)


def _generate_moe_tp2(target: str, head: str) -> list[list[int]]:
    from tllm_spec.model.moe import MoE

    model = SpecModel.from_pretrained(target, eagle3(Path(head), 3), max_batch_size=2, tensor_parallel_size=WORLD_SIZE)
    moe = [m for m in model.target.fused.modules() if isinstance(m, MoE)]
    assert moe and all(m.tp_group is not None and m.gate_up.shape[1] == 2 * m.down.shape[2] == 2 * 32 // WORLD_SIZE
                       for m in moe)  # the tiny targets' experts are 32 wide
    return [o.token_ids for o in model.generate(PROMPTS, [SamplingParams(max_new_tokens=n) for n in MAX_NEW])]


@pytest.mark.slow  # three processes of tens of seconds on the 2-core machine
@pytest.mark.parametrize("arch, layout", [("glm4_moe", "per expert"),
                                          pytest.param("mixtral", "per expert", marks=pytest.mark.slow),
                                          pytest.param("qwen3_moe", "fused", marks=pytest.mark.slow)])
def test_tp2_moe_targets_equal_hf_generate(tmp_path, arch, layout):
    """Every expert split along its intermediate size (shared experts too, GLM's dense first layer as a dense
    MLP, the router whole), read from the published per-expert tensors (Mixtral's under block_sparse_moe) or
    the fused [E, 2I, H] / [E, H, I] ones."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from ..models import tiny_pair

    target, head = tiny_pair(arch)
    if layout == "fused":
        fused = tmp_path / "fused"
        model = AutoModelForCausalLM.from_pretrained(target)
        model.config.save_pretrained(fused)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(fused / "model.safetensors"))
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in model.state_dict())
        target = fused
    ranks = run_ranks(_generate_moe_tp2, str(target), str(head))
    assert_no_rank_failed(ranks)
    assert ranks[0] == ranks[1] == [hf_greedy(target, p, n) for p, n in zip(PROMPTS, MAX_NEW)]


MTP_MODES = {"eagle_k3": MTPConfig(num_nextn_predict_layers=1, max_draft_len=3),
             "vanilla3": MTPConfig(num_nextn_predict_layers=3, use_mtp_vanilla=True)}


def _mtp_facts(model: SpecModel) -> dict:
    """What a rank holds and computes of its MTP modules: the fused blocks whole (q/k/v rows, experts) without a
    tensor-parallel group, the KV layers' heads, the draft logits of fixed hidden states."""
    from tllm_spec.model.layers import DecoderLayer
    from tllm_spec.model.moe import MoE

    draft = model.worker.draft_model
    blocks = [m.block for m in draft.mtp_modules]
    assert all(isinstance(block, DecoderLayer) for block in blocks)
    groups = {type(m).__name__: m.tp_group for block in blocks for m in block.modules() if hasattr(m, "tp_group")}
    hidden = torch.randn(3, model.target.hidden_size, generator=torch.Generator().manual_seed(0))
    return {"qkv_rows": [block.self_attn.qkv_proj.out_features for block in blocks], "tp_groups": groups,
            "experts": [tuple(m.gate_up.shape) for block in blocks for m in block.modules() if isinstance(m, MoE)],
            "kv_heads": [k.shape[2] for k in model.runner.kv_cache.k],
            "own_heads": ["head" in m.shared_head for m in draft.mtp_modules],
            "logits": [draft.compute_logits(i, hidden).tolist() for i in range(len(blocks))]}


def _generate_mtp_tp2(target: str, modes: list[str]) -> dict:
    out = {}
    for mode in modes:
        model = SpecModel.from_pretrained(target, MTP_MODES[mode], max_batch_size=2, tensor_parallel_size=WORLD_SIZE)
        outs = model.generate(PROMPTS, [SamplingParams(max_new_tokens=n) for n in MAX_NEW])
        out[mode] = {"tokens": [o.token_ids for o in outs], "accepted": [o.stats.accepted_per_step for o in outs],
                     **_mtp_facts(model)}
    return out


def check_mtp_tp2(target: Path, modes: list[str]) -> list[dict]:
    """Both ranks: the target's greedy output, TP 1's accepted drafts per step and TP 1's draft logits (the draft
    rows gathered from both vocabulary halves; rank 1's half padded: vocabulary 97)."""
    ranks = run_ranks(_generate_mtp_tp2, str(target), modes)
    assert_no_rank_failed(ranks)
    assert ranks[0] == ranks[1]  # lockstep, and the replicated modules compute the same logits on both ranks
    hf = [hf_greedy(target, p, n) for p, n in zip(PROMPTS, MAX_NEW)]
    for mode in modes:
        tp1 = SpecModel.from_pretrained(target, MTP_MODES[mode], max_batch_size=2)
        tp1_outs = tp1.generate(PROMPTS, [SamplingParams(max_new_tokens=n) for n in MAX_NEW])
        got = ranks[0][mode]
        assert got["tokens"] == hf
        assert got["accepted"] == [o.stats.accepted_per_step for o in tp1_outs]
        torch.testing.assert_close(torch.tensor(got["logits"]), torch.tensor(_mtp_facts(tp1)["logits"]))
        assert set(got["tp_groups"].values()) == {None}  # no collective in a module's block
    return ranks


@pytest.mark.slow  # two processes of tens of seconds on the 2-core machine
def test_tp2_mtp_modules_equal_hf_generate():
    """A tiny Llama with 3 MTP modules (DeepSeek layout): MTP-Eagle K=3 and vanilla MTP with 3 modules, each rank
    holding the modules whole (their 2 KV heads, where the target's layers hold 1 per rank)."""
    from ..test_mtp_lossless import mtp_target

    target = mtp_target("llama", "deepseek")
    ranks = check_mtp_tp2(target, list(MTP_MODES))
    head_dim = 16
    assert ranks[0]["eagle_k3"]["qkv_rows"] == [(4 + 2 * 2) * head_dim]  # 4 query and 2 KV heads: whole
    assert ranks[0]["eagle_k3"]["kv_heads"] == [1] * 8 + [2]
    assert ranks[0]["vanilla3"]["kv_heads"] == [1] * 8 + [2] * 3


@pytest.mark.slow  # two processes of tens of seconds on the 2-core machine
def test_tp2_mtp_moe_module_equals_hf_generate():
    """The tiny GLM-4.5 target (its MoE layer split by expert intermediate size) with its MoE MTP module whole: all
    8 experts 32 wide, the router and shared expert on every rank."""
    from ..test_mtp_lossless import mtp_target

    ranks = check_mtp_tp2(mtp_target("glm4_moe", "deepseek"), ["eagle_k3"])
    facts = ranks[0]["eagle_k3"]
    assert facts["experts"] == [(8, 2 * 32, 64)] and facts["tp_groups"]["MoE"] is None
    assert facts["kv_heads"] == [1, 1, 2]


def _mtp_heads_tp2(target: str) -> dict:
    cfg = MTPConfig(num_nextn_predict_layers=3, use_mtp_vanilla=True)
    model = SpecModel.from_pretrained(target, cfg, max_batch_size=2, tensor_parallel_size=WORLD_SIZE)
    outs = model.generate(PROMPTS[:2], [SamplingParams(max_new_tokens=n) for n in MAX_NEW[:2]])
    heads = [m.shared_head["head"].weight.shape[0] for m in model.worker.draft_model.mtp_modules
             if "head" in m.shared_head]
    return {"tokens": [o.token_ids for o in outs], "head_rows": heads, **_mtp_facts(model)}


@pytest.mark.slow  # two processes of tens of seconds on the 2-core machine
def test_tp2_mtp_heads_a_copy_of_lm_head_is_dropped_on_every_rank(tmp_path):
    """Module 0's shared_head.head is a copy of lm_head (each rank compares its own rows: dropped, its logits the
    target's gathered ones); module 1's is its own (kept whole); module 2's equals lm_head on rank 0's rows only,
    so both ranks keep it (one decision for both: the gather is a collective)."""
    from tllm_spec.drafts.mtp.checkpoint import HEAD_KEY, save_mtp_weights
    from tllm_spec.drafts.mtp.model import random_mtp_modules

    from ..models import hf_model

    target = save_random_target(tmp_path, target_config("llama", vocab_size=97), seed=5)
    lm_head = hf_model(target).lm_head.weight.detach()
    states = random_mtp_modules(target_config("llama", vocab_size=97), 3, seed=6, own_head=True)
    near_copy = lm_head.clone()
    near_copy[90] += 1.0  # a row of rank 1's half (rows 49-96)
    for state, head in zip(states, (lm_head, lm_head + 0.5 * states[1][HEAD_KEY], near_copy)):
        state[HEAD_KEY] = head.clone()
    save_mtp_weights(target, states, "deepseek")
    ranks = run_ranks(_mtp_heads_tp2, str(target))
    assert_no_rank_failed(ranks)
    assert ranks[0] == ranks[1]
    assert ranks[0]["own_heads"] == [False, True, True] and ranks[0]["head_rows"] == [97, 97]
    assert ranks[0]["tokens"] == [hf_greedy(target, p, n) for p, n in zip(PROMPTS[:2], MAX_NEW[:2])]
    tp1 = SpecModel.from_pretrained(target, MTPConfig(num_nextn_predict_layers=3, use_mtp_vanilla=True),
                                    max_batch_size=2)
    assert _mtp_facts(tp1)["own_heads"] == [False, True, True]
    torch.testing.assert_close(torch.tensor(ranks[0]["logits"]), torch.tensor(_mtp_facts(tp1)["logits"]))


def _bad_configurations(three_heads: str, target: str, head: str) -> list[str]:
    errors = []
    attempts = [lambda: SpecModel.from_pretrained(target, eagle3(Path(head), 3), tensor_parallel_size=3),
                lambda: SpecModel.from_pretrained(three_heads, None, tensor_parallel_size=WORLD_SIZE),
                # MTP runs under tensor parallelism; a target without MTP modules fails on every rank
                lambda: SpecModel.from_pretrained(target, MTPConfig(), tensor_parallel_size=WORLD_SIZE)]
    for attempt in attempts:
        try:
            attempt()
            errors.append("no error")
        except ValueError as err:
            errors.append(str(err))
    dist.barrier()  # every rank is still responsive after the errors
    return errors


@pytest.mark.slow  # ten seconds or more on the 2-core CI machine: the second CI command runs it
def test_bad_configurations_fail_on_every_rank_without_hanging():
    three_heads, _ = tiny_tp_pair("llama", hidden_size=96, num_attention_heads=3, num_key_value_heads=3)
    target, head = tiny_tp_pair("llama")
    ranks = run_ranks(_bad_configurations, str(three_heads), str(target), str(head))
    for errors in ranks:
        assert isinstance(errors, list), errors
        assert "tensor_parallel_size=3 but the torch.distributed world has 2 ranks" in errors[0]
        assert "3 attention heads are not divisible by 2" in errors[1]
        assert "no MTP tensors; expected model.layers.8.eh_proj.weight" in errors[2]


def _all_reduce_add_norm_on_gloo() -> list:
    from tllm_spec.distributed.parallel import all_reduce_add_norm, all_reduce_add_norm_ref
    from tllm_spec.kernels.rms_norm import rms_norm_ref

    group, rank = dist.group.WORLD.group_name, dist.get_rank()
    x = torch.full((3, 8), float(rank + 1)) + torch.arange(8.0)
    residual, weight = torch.ones(3, 8), torch.linspace(0.5, 1.5, 8)
    hidden, normed = all_reduce_add_norm(x, residual, weight, 1e-6, group)
    expected = residual + 3 + 2 * torch.arange(8.0)  # ranks 1 and 2, plus twice the column
    alone, none = all_reduce_add_norm(x, None, None, 1e-6, group)
    ref = all_reduce_add_norm_ref(x, residual, weight, 1e-6, group)
    return [torch.equal(hidden, expected), torch.allclose(normed, rms_norm_ref(expected, weight, 1e-6)),
            torch.equal(alone, expected - 1), none is None, torch.equal(ref[0], hidden), torch.equal(ref[1], normed)]


@pytest.mark.slow  # two processes: ten seconds on the 2-core machine
def test_all_reduce_add_norm_on_cpu_ranks_is_the_sum_the_add_and_the_norm():
    """The path of every input the Lamport kernel does not take (gloo here): the reference's ops."""
    ranks = run_ranks(_all_reduce_add_norm_on_gloo)
    assert ranks == [[True] * 6] * WORLD_SIZE, ranks


def test_tensor_parallel_without_torchrun_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    target, head = tiny_tp_pair("llama")
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):
        SpecModel.from_pretrained(target, eagle3(head, 3), tensor_parallel_size=2)


def test_world_size_without_tensor_parallel_size_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    target, _ = tiny_tp_pair("llama")
    with pytest.raises(ValueError, match="tensor_parallel_size=1 but this process was started with WORLD_SIZE=2"):
        SpecModel.from_pretrained(target, None)


def test_tensor_parallel_needs_the_fused_layers():
    with pytest.raises(ValidationError, match="use_fused_layers"):
        EngineConfig(tensor_parallel_size=2, use_fused_layers=False)


@pytest.mark.parametrize("kv_heads,size,expected", [(8, 2, [(0, 4), (4, 8)]), (2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)]),
                                                    (1, 2, [(0, 1), (0, 1)])])
def test_kv_heads_split_or_replicated(kv_heads, size, expected):
    assert [TensorParallel(r, size, "g").kv_heads(kv_heads) for r in range(size)] == expected


@pytest.mark.parametrize("overrides,message", [
    (dict(num_attention_heads=6, num_key_value_heads=6), "6 attention heads"),
    (dict(num_key_value_heads=3, num_attention_heads=12), "3 KV heads"),
    (dict(intermediate_size=130), "intermediate_size 130")])
def test_check_shardable_names_the_problem(overrides, message):
    with pytest.raises(ValueError, match=message):
        check_shardable(target_config("llama", **{"hidden_size": 96, **overrides}), 4)


def test_check_shardable_accepts_a_fitting_target():
    check_shardable(target_config("llama"), 2)


@pytest.mark.slow  # real processes or compiles: ten seconds or more (the second CI command)
def test_torchrun_generate_script_tp2(tmp_path):
    """The documented launch: torchrun --nproc-per-node 2 scripts/generate.py --tensor-parallel-size 2, on a
    checkpoint saved as several safetensors files (index), strings through the tokenizer; rank 0 reports."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    target, head = tiny_tp_pair("llama")
    sharded = tmp_path / "target"
    AutoModelForCausalLM.from_pretrained(target).save_pretrained(sharded, max_shard_size="200KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(97)}, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(sharded)
    out = tmp_path / "out.json"
    script = Path(__file__).parents[2] / "scripts" / "generate.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           "--tensor-parallel-size", "2", "--target", str(sharded), "--draft", str(head), "--device", "cpu",
           "--dtype", "float32", "--prompt", "w5 w17 w3", "--max-new-tokens", "6", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["config"]["engine"]["tensor_parallel_size"] == 2
    assert data["outputs"][0]["token_ids"] == hf_greedy(target, [5, 17, 3], 6)
    assert done.stdout.count("w5 w17 w3") == 1  # printed by rank 0 only


EXIT_PROGRAM = """
import os, sys, time
from pathlib import Path
import torch
from tllm_spec import SamplingParams, SpecModel
from tests.models import eagle3
target, head, device, fail_rank = sys.argv[1:5]
model = SpecModel.from_pretrained(target, eagle3(Path(head), 3), device=device, dtype=torch.float32,
                                  max_batch_size=2, tensor_parallel_size=2, compile_step=False)
rank = int(os.environ["RANK"])
for _ in range(2):  # the failing rank raises after the first; its peer then waits in the second's collectives
    model.generate([[5, 17, 3]], SamplingParams(max_new_tokens=8))
    if rank == int(fail_rank):
        print(f"END {time.time()}", flush=True)
        raise RuntimeError(f"rank {rank} fails on purpose")
print(f"END {time.time()}", flush=True)
"""


def torchrun_until_exit(device: str, fail_rank: int, timeout: float = TIMEOUT_S) -> tuple[int, float, str]:
    """A program that builds a TP2 model and decodes under torchrun (``fail_rank`` raises after its first
    generate; -1: none): (torchrun's exit status, seconds from the last program end a rank printed to torchrun's
    exit, the output)."""
    import time

    target, head = tiny_tp_pair("llama")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python",
           sys.executable, "-c", EXIT_PROGRAM, str(target), str(head), device, str(fail_rank)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    ended = time.time()
    ends = [float(line.split()[-1]) for line in done.stdout.splitlines() if line.startswith("END ")]
    return done.returncode, ended - max(ends) if ends else float("inf"), done.stdout + done.stderr


@pytest.mark.slow  # real processes or compiles: ten seconds or more (the second CI command)
def test_torchrun_ranks_exit_after_the_program_ends():
    code, seconds, output = torchrun_until_exit("cpu", -1)
    assert code == 0, output[-3000:]
    assert output.count("END ") == 2 and seconds < 10, (seconds, output[-3000:])
    assert "Traceback" not in output


@pytest.mark.slow  # real processes or compiles: ten seconds or more (the second CI command)
def test_a_rank_that_raises_ends_every_rank_with_its_error_printed_once():
    code, seconds, output = torchrun_until_exit("cpu", 1)
    assert code != 0 and seconds < 30, (code, seconds, output[-3000:])
    assert output.count("rank 1 fails on purpose") == 1, output[-3000:]


def _random_tp2_model(workdir: str) -> dict:
    from tllm_spec.tools.benchmark import step_bytes
    from tllm_spec.tools.random_models import random_spec_model
    model = random_spec_model("tiny", "eagle3", 3, workdir, torch.float32, "cpu", max_batch_size=2,
                              tensor_parallel_size=WORLD_SIZE)
    outs = model.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=6, ignore_eos=True))
    layer = model.target.hf.model.layers[0]
    plain = SpecModel.from_target(model.target, None, max_batch_size=2, tensor_parallel_size=WORLD_SIZE)
    return {"tokens": [o.token_ids for o in outs], "embed": model.target.embed(torch.arange(5)).sum().item(),
            "q_proj": layer.self_attn.q_proj.weight.sum().item(), "q_rows": layer.self_attn.q_proj.out_features,
            "bytes": step_bytes(plain, 2, 10)}


@pytest.mark.slow  # ten seconds or more on the 2-core CI machine: the second CI command runs it
def test_random_sharded_target_for_benchmarks(tmp_path):
    """benchmark.py's random targets at TP2: whole tensors equal on both ranks, shards their own, half the rows,
    and a per-GPU roofline that counts only this rank's bytes (about half of the target's)."""
    ranks = run_ranks(_random_tp2_model, str(tmp_path))
    assert_no_rank_failed(ranks)
    assert ranks[0]["tokens"] == ranks[1]["tokens"] and all(len(t) == 6 for t in ranks[0]["tokens"])
    assert ranks[0]["embed"] == ranks[1]["embed"] and ranks[0]["q_proj"] != ranks[1]["q_proj"]
    assert ranks[0]["q_rows"] == 64 // WORLD_SIZE
    from tllm_spec.tools.benchmark import step_bytes
    from tllm_spec.tools.random_models import random_spec_model
    tp1 = random_spec_model("tiny", "none", 0, tmp_path, torch.float32, "cpu", max_batch_size=2)
    assert 0.45 * step_bytes(tp1, 2, 10) < ranks[0]["bytes"] < 0.55 * step_bytes(tp1, 2, 10)


def _random_tp2_mtp_model(workdir: str) -> dict:
    from tllm_spec.tools.benchmark import run_point
    from tllm_spec.tools.random_models import random_spec_model
    from tllm_spec.tools.routing import moe_layers
    model = random_spec_model("tiny-glm4-moe", "mtp", 3, workdir, torch.float32, "cpu", max_batch_size=2,
                              tensor_parallel_size=WORLD_SIZE)
    (module,) = model.worker.draft_model.mtp_modules
    experts = moe_layers(model.worker.draft_model)[0]
    point = run_point(model, batch=2, prompt_len=8, new_tokens=12, forced=3.0, bandwidth=1e12)
    return {"module": [module.eh_proj.weight.sum().item(), experts.module.gate_up.sum().item()],
            "expert_rows": experts.module.gate_up.shape[1],
            "target_rows": moe_layers(model.target)[0].module.gate_up.shape[1],
            "draft_experts": point.draft_experts_per_step, "routing_same_tokens": point.routing_same_tokens}


@pytest.mark.slow  # ten seconds or more on the 2-core CI machine: the second CI command runs it
def test_random_sharded_target_with_a_random_mtp_module_for_benchmarks(tmp_path, monkeypatch):
    """benchmark.py --mtp at TP2: each rank draws the same whole MTP module (its own directory), the target's experts
    split; a point's roofline counts the draft's passes' experts."""
    from tllm_spec.sampling.forcing import ENV_VAR
    monkeypatch.setenv(ENV_VAR, "")  # run_point forces acceptance in the ranks: restored for the next tests
    ranks = run_ranks(_random_tp2_mtp_model, str(tmp_path))
    assert_no_rank_failed(ranks)
    assert ranks[0]["module"] == ranks[1]["module"]  # replicated: the same draw on every rank
    assert ranks[0]["expert_rows"] == 2 * 32 and ranks[0]["target_rows"] == 2 * 32 // WORLD_SIZE
    assert ranks[0]["draft_experts"] == ranks[1]["draft_experts"] and 3 * 2 <= ranks[0]["draft_experts"] <= 3 * 8
    assert ranks[0]["routing_same_tokens"] and ranks[1]["routing_same_tokens"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-glm4-moe-mtp-rank0", "tiny-glm4-moe-mtp-rank1"]


def _pages_of_rank(pages: list[int], target: str, head: str) -> int:
    """The KV pool a rank builds when its own memory would allow ``pages[rank]`` pages."""
    from tllm_spec.engine import runner as runner_module

    rank = dist.get_rank()
    runner_module._auto_num_pages = lambda *args: pages[rank]
    model = SpecModel.from_pretrained(target, eagle3(Path(head), 3), max_batch_size=2, tensor_parallel_size=WORLD_SIZE)
    return model.runner.num_kv_pages


@pytest.mark.slow  # two processes
def test_every_rank_builds_the_smallest_kv_pool_of_any_rank():
    """Ranks size their pools from their own free memory; they must agree, or admission diverges and a collective
    hangs."""
    target, head = tiny_tp_pair("llama")
    assert run_ranks(_pages_of_rank, [40, 25], str(target), str(head)) == [25, 25]
