"""Running a step ahead: while a graphed batch stays the same, the engine launches the next step on inputs the
device advances from the step's own outputs, before the host reads them. Checked on the CPU through the graph
runner's bookkeeping (static buffers, padding to buckets; a replay runs the step eagerly): the advanced inputs
are exactly what the host would build, and decoding stays lossless while requests end at different steps, wait
for a slot, and finish by stop token or length."""
import pytest
import torch

from tllm_spec import SamplingParams
from tllm_spec.engine.cuda_graphs import CUDAGraphRunner, advance_inputs
from tllm_spec.engine.runner import ModelRunner
from tllm_spec.spec_model import SpecModel

from ..models import eagle3, hf_greedy, tiny_pair

K = 3


def count_steps_run_ahead(monkeypatch) -> list[int]:
    """A one-item list that counts the steps the engine launches ahead from now on."""
    count, run_next = [0], CUDAGraphRunner.run_next

    def counting(self):
        count[0] += 1
        return run_next(self)
    monkeypatch.setattr(CUDAGraphRunner, "run_next", counting)
    return count


def test_advanced_inputs_are_what_the_host_builds():
    g = torch.Generator().manual_seed(0)
    num_requests, draft_len, bucket, padding_slot = 3, 2, 4, 5
    per_request = draft_len + 1
    num_cached, slots = [7, 20, 3, 0], [2, 0, 1, padding_slot]  # three requests, one padding row
    inputs = torch.full((4, bucket * per_request), -1, dtype=torch.int64)
    tokens = num_requests * per_request
    inputs[1] = torch.tensor([c + i for c in num_cached for i in range(per_request)])
    inputs[2] = torch.tensor([s for s in slots for _ in range(per_request)])
    padding = inputs[:, tokens:].clone()
    packed = torch.randint(0, 100, (bucket, 2 * K + 3), generator=g)
    packed[:, K + 1] = torch.tensor([1, 3, 2, 2])  # accepted counts
    advance_inputs(inputs, packed, bucket, draft_len, K, padding_slot)
    rows = packed[:num_requests].tolist()
    next_inputs = [row[K + 2:K + 3 + draft_len] for row in rows]  # Engine._complete's arithmetic
    assert inputs[0, :tokens].tolist() == [t for nxt in next_inputs for t in nxt]
    assert inputs[1, :tokens].tolist() == [c + row[K + 1] + i for c, row in zip(num_cached, rows)
                                           for i in range(per_request)]
    assert inputs[2, :tokens].tolist() == [s for s in slots[:num_requests] for _ in range(per_request)]
    assert inputs[3, :num_requests * draft_len].tolist() == [t for nxt in next_inputs for t in nxt[1:]]
    assert torch.equal(inputs[1:3, tokens:], padding[1:3])  # the padding row's positions and slot stay


def test_run_ahead_decodes_losslessly(monkeypatch):
    target, head = tiny_pair("llama")
    max_seq_len = 57  # + 2K + 1 fills whole pages of 16: a block table without room for a step ahead would overflow
    model = SpecModel.from_pretrained(target, eagle3(head, K), dtype=torch.float32, max_batch_size=4,
                                      max_seq_len=max_seq_len)  # a batch of 3 pads to the bucket of 4
    model.runner.graph_runner = model.runner.new_graph_runner()  # the graphed path, replayed eagerly
    launched = count_steps_run_ahead(monkeypatch)
    prompts = [[5, 17, 3, 44, 9], [12, 8], [7] * 9, [1, 2, 3], [30, 31]]
    max_new = [40, 45, 31, 12, 36]  # five requests for four slots: one waits, batches change as requests end
    max_new[2] = max_seq_len - len(prompts[2])  # ends at max_seq_len, with a step for it already launched
    params = [SamplingParams(max_new_tokens=n) for n in max_new]
    # the second request stops at its 10th token, mid-run, while a step for it is already launched
    params[1] = params[1].model_copy(update={"stop_token_ids": [hf_greedy(target, prompts[1], 45)[9]]})
    outputs = model.generate(prompts, params)
    assert launched[0] > 10
    for prompt, n, p, out in zip(prompts, max_new, params, outputs):
        expected = hf_greedy(target, prompt, n)
        if p.stop_token_ids:
            expected = expected[:expected.index(p.stop_token_ids[0]) + 1]
        assert out.token_ids == expected, prompt
    monkeypatch.setattr(CUDAGraphRunner, "can_run_next", lambda self: False)
    in_step = model.generate(prompts, params)  # one step at a time: the same steps and acceptance
    assert [o.stats for o in outputs] == [o.stats for o in in_step]
    for key in ("decode_steps", "mean_decode_batch"):  # a step's dropped rows are not counted
        assert outputs.stats[key] == in_step.stats[key], key
    assert [o.finish_reason for o in outputs] == ["length", "stop", "length", "length", "length"]


@pytest.mark.parametrize("k", [3, 4])
def test_a_step_ahead_of_a_request_at_max_seq_len_stays_in_its_tables(k, monkeypatch):
    """Every draft accepted (forced) and a prompt of 7 (K = 3) or 5 (K = 4): the request reaches max_seq_len with
    the most positions a step ahead can touch, max_seq_len + 3K - 2 (past a block table or RoPE table sized for
    max_seq_len + 2K + 2; the CPU reference's indexing fails there). Outputs equal one step at a time."""
    monkeypatch.setenv("TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS", str(k))
    target, head = tiny_pair("llama")
    max_seq_len = 57 if k == 3 else 52  # + 2K + 1 fills whole pages of 16
    model = SpecModel.from_pretrained(target, eagle3(head, k), dtype=torch.float32, max_batch_size=2,
                                      max_seq_len=max_seq_len)
    model.runner.graph_runner = model.runner.new_graph_runner()
    prompts = [[5, 17, 3, 44, 9, 2, 71][:7 if k == 3 else 5], [12, 8]]
    params = [SamplingParams(max_new_tokens=60)] * 2
    launched = count_steps_run_ahead(monkeypatch)
    ahead = model.generate(prompts, params)
    assert launched[0] > 5
    monkeypatch.setattr(CUDAGraphRunner, "can_run_next", lambda self: False)
    in_step = model.generate(prompts, params)
    assert [len(o.prompt_token_ids) + len(o.token_ids) for o in ahead] == [max_seq_len] * 2
    assert [o.token_ids for o in ahead] == [o.token_ids for o in in_step]
    assert ahead.stats["decode_steps"] == in_step.stats["decode_steps"]


def test_sampled_requests_with_seeds_run_ahead_as_in_eager(monkeypatch):
    """A request's own seed keys its numbers by its positions, so a step run ahead (which keeps an ended
    request's row) leaves them alone; batch-stream rows are numbered by their place in the batch and equal eager's
    one step at a time (README: the engine runs a step ahead)."""
    target, head = tiny_pair("llama")
    prompts = [[5, 17, 3, 44, 9, 2, 71], [12, 8], [60, 61, 62, 63, 1, 2, 3, 4, 5], [33, 34, 35, 36], [90, 1, 90]]
    seeded = [SamplingParams(max_new_tokens=n, temperature=0.0 if i % 2 else 0.9, top_p=0.95,
                             seed=None if i % 2 else 40 + i) for i, n in enumerate([20, 9, 17, 25, 12])]
    graphed = SpecModel.from_pretrained(target, eagle3(head, K), dtype=torch.float32, max_batch_size=8)
    graphed.runner.graph_runner = graphed.runner.new_graph_runner()
    eager = SpecModel.from_pretrained(target, eagle3(head, K), dtype=torch.float32, max_batch_size=8)
    launched = count_steps_run_ahead(monkeypatch)
    ahead, expected = graphed.generate(prompts, seeded, seed=5), eager.generate(prompts, seeded, seed=5)
    assert launched[0] > 0
    assert [(o.token_ids, o.stats) for o in ahead] == [(o.token_ids, o.stats) for o in expected]
    batch_stream = [p.model_copy(update={"seed": None}) for p in seeded]
    monkeypatch.setattr(CUDAGraphRunner, "can_run_next", lambda self: False)
    in_step, expected = graphed.generate(prompts, batch_stream, seed=5), eager.generate(prompts, batch_stream, seed=5)
    assert [(o.token_ids, o.stats) for o in in_step] == [(o.token_ids, o.stats) for o in expected]


@pytest.mark.slow  # three to four seconds on the 2-core machine, out of the README command for its margin
def test_prompts_joining_a_graphed_batch_run_beside_its_graph(monkeypatch):
    """A step where new prompts join decoding requests replays the decoders' graph and runs the prompts as an
    eager step of their own: outputs, acceptance and sampled tokens (request seeds) equal an engine without graphs
    (rows of the batch stream draw other numbers: the two parts number their rows apart); with logprobs asked on
    one side only, the batch runs as one eager step."""
    target, head = tiny_pair("llama")
    prompts = [[5, 17, 3, 44, 9, 2, 71], [12, 8], [60, 61, 62, 63, 1, 2, 3, 4, 5], [33, 34, 35, 36], [90, 1, 90]]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0 if i % 2 else 0.9, top_p=0.95,
                             seed=40 + i) for i, n in enumerate([20, 9, 17, 25, 12])]
    graphed = SpecModel.from_pretrained(target, eagle3(head, K), dtype=torch.float32, max_batch_size=2)
    graphed.runner.graph_runner = graphed.runner.new_graph_runner()
    eager = SpecModel.from_pretrained(target, eagle3(head, K), dtype=torch.float32, max_batch_size=2)
    beside: list[int] = []  # generation requests replayed in steps that also prefill
    graph_run, eager_step = CUDAGraphRunner.run, type(graphed.runner)._eager_step

    def run(self, ids, positions, slots, drafts, params, *args):
        beside.append(len(params))
        return graph_run(self, ids, positions, slots, drafts, params, *args)

    def prompt_step(self, ids, positions, slots, drafts, params, context_lens, *args):
        if beside and beside[-1] > 0 and context_lens:
            beside[-1] = -beside[-1]  # marks the last graph run as launched beside a prompt step
        return eager_step(self, ids, positions, slots, drafts, params, context_lens, *args)
    monkeypatch.setattr(CUDAGraphRunner, "run", run)
    monkeypatch.setattr(type(graphed.runner), "_eager_step", prompt_step)
    got, expected = graphed.generate(prompts, params, seed=3), eager.generate(prompts, params, seed=3)
    assert sum(n < 0 for n in beside) >= 3  # three requests waited for a slot and joined a decoding one
    assert [(o.token_ids, o.stats) for o in got] == [(o.token_ids, o.stats) for o in expected]
    for i, out in enumerate(got):
        if params[i].is_greedy:
            assert out.token_ids == hf_greedy(target, prompts[i], params[i].max_new_tokens)
    beside.clear()
    with_logprobs = [p.model_copy(update={"logprobs": 2}) if i in (0, 2) else p for i, p in enumerate(params)]
    got, expected = graphed.generate(prompts, with_logprobs, seed=3), eager.generate(prompts, with_logprobs, seed=3)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for out, ref in zip(got, expected):  # computed over other batches: equal to float32 rounding
        assert (out.logprobs is None) == (ref.logprobs is None)
        if out.logprobs is not None:
            torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref.logprobs))


def test_prompts_beside_the_graph_keep_a_draft_len_schedule(monkeypatch):
    """With a draft-length schedule and rejection sampling, a request that joins mid-run is prefilled beside the
    graphed decoders at the schedule's lengths: seeded and greedy tokens equal an engine without graphs."""
    target, head = tiny_pair("llama")
    config = eagle3(head, K).model_copy(update={"draft_len_schedule": {1: 3, 2: 2, 3: 1, 4: 0},
                                                "use_rejection_sampling": True})
    graphed, eager = (SpecModel.from_pretrained(target, config, dtype=torch.float32, max_batch_size=4)
                      for _ in range(2))
    graphed.runner.graph_runner = graphed.runner.new_graph_runner()
    monkeypatch.setattr(CUDAGraphRunner, "can_run_next", lambda self: False)
    prompts = [[5, 17, 3, 44, 9, 2, 71], [12, 8], [60, 61, 62, 63, 1, 2, 3, 4, 5], [33, 34, 35, 36], [90, 1, 90]]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0 if i % 2 else 0.9, seed=None if i % 2 else 40 + i)
              for i, n in enumerate([20, 9, 17, 25, 12])]
    got, expected = graphed.generate(prompts, params, seed=3), eager.generate(prompts, params, seed=3)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


@pytest.mark.slow  # five to six seconds a tree on the 2-core machine: the second CI command runs both
@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_draft_trees_through_the_graph_runner_equal_eager(tree, monkeypatch):
    """A draft tree's step as the graph runner runs it (static buffers padded to buckets, tree runs rotated and
    masked inside the step, steps run ahead on the device's own outputs, a prompt joining the batch run beside its
    graph), on the demo pair (its trained head
    accepts paths that leave the tree's first rows): greedy requests equal plain decoding, and greedy and seeded
    sampled requests (rejection sampling) equal an engine without graphs, steps and acceptance included."""
    from tllm_spec import Eagle3Config
    shape = (dict(max_draft_len=2, eagle_choices=[[0], [1], [2], [0, 0], [1, 0]]) if tree == "static" else
             dict(max_draft_len=3, use_dynamic_tree=True, dynamic_tree_max_topK=2, max_total_draft_tokens=6))
    config = Eagle3Config(speculative_model="demo://eagle3", use_rejection_sampling=True, **shape)
    graphed, eager, plain = (SpecModel.from_pretrained("demo://target", spec, dtype=torch.float32, device="cpu",
                                                       max_batch_size=4) for spec in (config, config, None))
    graphed.runner.graph_runner = graphed.runner.new_graph_runner()
    prompts = ["def fibonacci(n):\n", "import os\n\n\nclass ", "    for key, value in ", "class Stack:\n", "x = ["]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0 if i % 2 else 0.9, seed=None if i % 2 else 60 + i)
              for i, n in enumerate([20, 30, 17, 25, 12])]
    launched = count_steps_run_ahead(monkeypatch)
    beside, graphs_generation = [0], ModelRunner._graphs_generation

    def counting(self, params, num_ctx):  # a prompt joining the graphed batch, run beside its graph
        graphed_here = graphs_generation(self, params, num_ctx)
        beside[0] += graphed_here and num_ctx > 0
        return graphed_here
    monkeypatch.setattr(ModelRunner, "_graphs_generation", counting)
    ahead, expected = graphed.generate(prompts, params), eager.generate(prompts, params)
    assert launched[0] > 0 and beside[0] > 0
    assert [(o.token_ids, o.stats) for o in ahead] == [(o.token_ids, o.stats) for o in expected]
    greedy = plain.generate([prompts[1], prompts[3]], [params[1], params[3]])
    assert [ahead[1].token_ids, ahead[3].token_ids] == [o.token_ids for o in greedy]
