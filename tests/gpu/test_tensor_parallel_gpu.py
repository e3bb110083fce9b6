"""Tensor parallelism on 2 GPUs (NCCL): CUDA-graphed steps with the collectives inside the graph (one case
compiled: each compilation of a tensor-parallel step takes a minute or more), and torchrun jobs that end: every
rank exits after the program, and a rank that raises ends them all. Skipped unless 2 GPUs are visible."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tllm_spec import SamplingParams
from tllm_spec.distributed import lamport, symmetric
from tllm_spec.distributed.parallel import all_reduce_add_norm
from tllm_spec.kernels.rms_norm import rms_norm
from tllm_spec.spec_model import SpecModel

from ..distributed.test_tensor_parallel import (
    MAX_NEW,
    PROMPTS,
    WORLD_SIZE,
    run_ranks,
    tiny_tp_pair,
    torchrun_until_exit,
)
from ..models import eagle3, hf_greedy

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(torch.cuda.device_count() < WORLD_SIZE,
                                                    reason=f"needs {WORLD_SIZE} GPUs")]


def _greedy(target: str, head: str | None, dtype: torch.dtype, tensor_parallel_size: int, compile_step: bool,
            tp_draft: str = "replicated", tree: bool = False) -> dict:
    spec = eagle3(Path(head), 3) if head else None
    if tree:  # a dynamic tree: the split head's frontier logits gathered as B x F rows
        spec = spec.model_copy(update={"use_dynamic_tree": True, "dynamic_tree_max_topK": 2,
                                       "max_total_draft_tokens": 6})
    with SpecModel.from_pretrained(target, spec, dtype=dtype, device="cuda", max_batch_size=4,
                                   tensor_parallel_size=tensor_parallel_size, compile_step=compile_step,
                                   tp_draft=tp_draft if tensor_parallel_size > 1 else "replicated") as model:
        outs = model.generate(PROMPTS, [SamplingParams(max_new_tokens=n) for n in MAX_NEW])  # closed before the
        return {"tokens": [o.token_ids for o in outs], "graphs": len(model.runner.graph_runner.graphs),  # group
                "lamport": any(key[1] == dtype for key in lamport._registry)}


@pytest.mark.parametrize("dtype,speculative,tp_draft,tree", [
    pytest.param(torch.bfloat16, True, "replicated", False, marks=pytest.mark.compiles),
    (torch.float32, True, "replicated", False), (torch.float32, False, "replicated", False),
    (torch.bfloat16, False, "replicated", False), (torch.float32, True, "sharded", False),
    (torch.float32, True, "auto", True)])
def test_tp2_graphed_greedy_equals_tp1(dtype, speculative, tp_draft, tree):
    """tp_draft="sharded" (and "auto", the default, for an EAGLE-3 head it can split): the head split like the
    target, its o and down sums all-reduced in the graph; with a dynamic tree, its frontier's logits gathered."""
    target, head = tiny_tp_pair("llama")
    head = str(head) if speculative else None
    compile_step = dtype == torch.bfloat16 and speculative
    ranks = run_ranks(_greedy, str(target), head, dtype, WORLD_SIZE, compile_step, tp_draft, tree, backend="nccl")
    for answer in ranks:
        assert isinstance(answer, dict), answer
    assert ranks[0] == ranks[1] and ranks[0]["graphs"] > 0  # steps replayed CUDA graphs with NCCL inside
    assert ranks[0]["lamport"] == (dtype == torch.bfloat16)  # bf16 steps all-reduced through the Lamport kernel
    tp1 = _greedy(str(target), head, dtype, 1, compile_step, tree=tree)
    assert ranks[0]["tokens"] == tp1["tokens"]
    if dtype == torch.float32:
        assert tp1["tokens"] == [hf_greedy(target, p, n) for p, n in zip(PROMPTS, MAX_NEW)]


def _lamport_against_nccl() -> list:
    group, rank = dist.group.WORLD.group_name, dist.get_rank()
    device = torch.device("cuda", rank)
    assert symmetric.enable(group, torch.bfloat16, device)
    c10d, answers = torch.ops._c10d_functional, []
    for rows, width in [(1, 4096), (4, 4096), (200, 64), (3, 2048), (1, 4096)]:
        g = torch.Generator(device).manual_seed(rows * width + rank)
        x = torch.randn(rows, width, device=device, generator=g).bfloat16()
        x[0, 0] = -0.0  # the kernel's empty mark, as a value
        same = torch.Generator(device).manual_seed(rows * width)  # residual and weight alike on every rank
        residual = torch.randn(rows, width, device=device, generator=same).bfloat16()
        weight = (1 + 0.1 * torch.randn(width, device=device, generator=same)).bfloat16()
        assert lamport.buffers_for(x, group) is not None
        hidden, normed = all_reduce_add_norm(x, residual, weight, 1e-5, group)
        ref = residual + c10d.wait_tensor(c10d.all_reduce(x, "sum", group))
        answers.append((torch.equal(hidden, ref), torch.equal(normed, rms_norm(ref, weight, 1e-5)),
                        float(hidden.double().sum())))
    return answers


def test_lamport_all_reduce_over_nvlink_equals_nccl_with_the_add_and_norm():
    ranks = run_ranks(_lamport_against_nccl, backend="nccl")
    assert isinstance(ranks[0], list), ranks
    assert ranks[0] == ranks[1]  # the same bits on both ranks
    assert all(hidden_equal and normed_equal for hidden_equal, normed_equal, _ in ranks[0]), ranks[0]


def test_torchrun_ranks_exit_within_10_s_of_the_program_end():
    """NCCL ranks once hung at exit: the communicator could not close while CUDA graphs that captured its
    collectives were alive (the engine's thread kept the model)."""
    code, seconds, output = torchrun_until_exit("cuda", -1)
    assert code == 0, output[-3000:]
    assert output.count("END ") == 2 and seconds < 10, (seconds, output[-3000:])


def test_a_rank_that_raises_ends_every_rank_within_30_s():
    code, seconds, output = torchrun_until_exit("cuda", 1)
    assert code != 0 and seconds < 30, (code, seconds, output[-3000:])
    assert output.count("rank 1 fails on purpose") == 1, output[-3000:]
