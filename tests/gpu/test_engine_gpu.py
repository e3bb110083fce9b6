"""The graphed engine on the GPU: replay == eager, lossless greedy, no host sync inside the step. Tests whose
subject is not the compiled step capture eager kernels (compile_step=False): a torch.compile costs up to 90 s."""
import pytest
import torch

from tllm_spec import MTPConfig, SamplingParams, trace_cache
from tllm_spec.engine.cuda_graphs import CUDAGraphRunner, generation_step
from tllm_spec.model import layers
from tllm_spec.model.layers import DecoderLayer
from tllm_spec.sampling import flashinfer_ops
from tllm_spec.spec_model import SpecModel

from ..engine.test_run_ahead import count_steps_run_ahead
from ..engine.test_step_graph import breaks_elsewhere
from ..models import eagle3, hf_greedy, tiny_pair
from ..test_mtp_lossless import mtp_target

pytestmark = pytest.mark.cuda
PROMPTS = [[5, 17, 3, 44, 9, 2, 71], [12, 8], [60, 61, 62, 63, 1, 2, 3, 4, 5], [33, 34, 35, 36], [90, 1, 90]]
MAX_NEW = [20, 9, 17, 25, 12]


def _model(arch, k, dtype, eager, **kw):
    target, head = tiny_pair(arch)
    spec = eagle3(head, k) if k else None
    return target, SpecModel.from_pretrained(target, spec, dtype=dtype, device="cuda", enforce_eager=eager,
                                             **{"compile_step": True, "max_batch_size": 8, **kw})


# one case checks the step compiled whole (the default for large targets); the rest capture eager kernels
@pytest.mark.parametrize("arch,k", [pytest.param(a, k, marks=[pytest.mark.compiles] if (a, k) == ("llama", 3) else [])
                                    for k in (0, 1, 3) for a in ("llama", "qwen3", "mistral")])
def test_graphed_greedy_is_lossless_fp32(arch, k):
    target, model = _model(arch, k, torch.float32, eager=False, compile_step=(arch, k) == ("llama", 3))
    outs = model.generate(PROMPTS, [SamplingParams(max_new_tokens=n) for n in MAX_NEW])
    assert model.runner.graph_runner is not None and model.runner.graph_runner.graphs, "no CUDA graph was used"
    for p, n, out in zip(PROMPTS, MAX_NEW, outs):
        assert out.token_ids == hf_greedy(target, p, n)


def test_two_engines_over_one_target_capture_their_own_kv_cache():
    """A plain and a speculative engine over one target (as scripts/benchmark.py builds them): the one built last
    bound its KV pool to the shared attention layers, so each graph runner binds its own before capturing: the
    speculative graphs, captured directly, write only their own pool and decode as the plain engine does."""
    target, spec = _model("llama", 3, torch.float32, eager=False, compile_step=False)
    plain = SpecModel.from_target(spec.target, None, max_batch_size=8, compile_step=False)
    untouched = [t.clone() for t in (*plain.runner.kv_cache.k, *plain.runner.kv_cache.v)]
    spec.runner.graph_runner.capture_all(progress=False)
    params = [SamplingParams(max_new_tokens=n) for n in MAX_NEW]
    outs = spec.generate(PROMPTS, params)
    assert all(torch.equal(a, b) for a, b in zip(untouched, (*plain.runner.kv_cache.k, *plain.runner.kv_cache.v)))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(PROMPTS, params)]
    assert [o.token_ids for o in outs] == [hf_greedy(target, p, n) for p, n in zip(PROMPTS, MAX_NEW)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_equals_eager(dtype, monkeypatch):
    """Sampled requests with their own seeds equal eager's while steps run ahead; rows of the batch stream (no
    request seed: numbered by their place in the batch) too when steps run one at a time. A step run ahead keeps
    an ended request's row, which moves the numbers of the rows after it (README: the engine runs a step ahead)."""
    seeded = [SamplingParams(max_new_tokens=n, temperature=0.0 if i % 2 else 0.9, top_p=0.95,
                             seed=None if i % 2 else 40 + i) for i, n in enumerate(MAX_NEW)]
    _, graphed = _model("llama", 3, dtype, eager=False, compile_step=False)
    _, eager = _model("llama", 3, dtype, eager=True)
    launched = count_steps_run_ahead(monkeypatch)
    _assert_same_outputs(graphed.generate(PROMPTS, seeded, seed=5), eager.generate(PROMPTS, seeded, seed=5))
    assert launched[0] > 0
    batch_stream = [p.model_copy(update={"seed": None}) for p in seeded]
    monkeypatch.setattr(CUDAGraphRunner, "can_run_next", lambda self: False)
    _assert_same_outputs(graphed.generate(PROMPTS, batch_stream, seed=5),
                         eager.generate(PROMPTS, batch_stream, seed=5))


def _assert_same_outputs(a, b):
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids  # same seeds: sampled rows equal too
        assert x.stats.accepted_per_step == y.stats.accepted_per_step


def test_forced_acceptance_inside_graph(monkeypatch):
    monkeypatch.setenv("TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS", "1.5")
    _, model = _model("llama", 3, torch.bfloat16, eager=False, compile_step=False)
    outs = model.generate(PROMPTS, SamplingParams(max_new_tokens=40))
    per_step = [n for o in outs for n in o.stats.accepted_per_step]
    assert set(per_step) == {2, 3}
    assert 0.3 < per_step.count(3) / len(per_step) < 0.7


def test_no_host_sync_inside_generation_step():
    _, model = _model("llama", 3, torch.float32, eager=True)
    assert_no_host_sync_in_generation_steps(model, PROMPTS[:2])


def assert_no_host_sync_in_generation_steps(model, prompts) -> None:
    """Generate with CUDA's sync debug mode raising inside every generation-only step's forward (prompt steps may
    plan on the host); at least three such steps run."""
    model.generate(prompts, SamplingParams(max_new_tokens=4))  # warm-up: JIT, allocations
    original, step, calls = model.runner.model.forward, model.runner.step, []

    def strict_forward(*args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return original(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def generation_only(ids, positions, slots, drafts, params, context_lens, *rest, **kw):
        calls.append(bool(context_lens))
        model.runner.model.forward = original if context_lens else strict_forward
        return step(ids, positions, slots, drafts, params, context_lens, *rest, **kw)

    model.runner.step = generation_only
    model.generate(prompts, SamplingParams(max_new_tokens=16))
    assert calls.count(False) >= 3


@pytest.mark.compiles
@pytest.mark.parametrize("fused", [True, False])
def test_compiled_step_is_lossless(fused):
    target, model = _model("qwen2", 3, torch.float32, eager=False, use_fused_layers=fused)
    assert (model.target.fused is not None) == fused
    outs = model.generate(PROMPTS, [SamplingParams(max_new_tokens=n) for n in MAX_NEW])
    for p, n, out in zip(PROMPTS, MAX_NEW, outs):
        assert out.token_ids == hf_greedy(target, p, n)


@pytest.mark.compiles
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compiled_graphed_bf16_equals_eager(arch, monkeypatch):
    """The default fast path (compiled, graphed) and the eager path over the same fused layers give the same
    greedy tokens in bf16 on a small model (fused vs split GEMMs differ in bf16 rounding: the fp32 tests
    against HF generate cover that equivalence)."""
    _, fast = _model(arch, 3, torch.bfloat16, eager=False)
    _, eager = _model(arch, 3, torch.bfloat16, eager=True)
    assert fast.runner.compiles_step_whole and fast.runner.graph_runner.step is not generation_step
    params = [SamplingParams(max_new_tokens=n) for n in MAX_NEW]
    for x, y in zip(fast.generate(PROMPTS, params), eager.generate(PROMPTS, params)):
        assert x.token_ids == y.token_ids
    monkeypatch.setenv("TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS", "2")
    fast.runner.refresh_forced_acceptance()  # forcing turns on: drops the graphs, keeps the compiled step
    assert not fast.runner.graph_runner.graphs and fast.runner.graph_runner.step is not generation_step


@pytest.mark.compiles
@pytest.mark.parametrize("spec", ["eagle3", "mtp"])
def test_few_row_kernels_compiled_graphed_equal_eager_in_bf16(spec, monkeypatch):
    """Steps of at most 32 rows take the few-row path (norm kernel, GEMM epilogues) in bf16: compiled and graphed,
    they give the eager path's tokens; a batch of nine requests' chains (36 rows) takes the other path in both."""
    def build(eager):
        if spec == "eagle3":
            return _model("llama", 3, torch.bfloat16, eager=eager, max_batch_size=16)[1]
        return SpecModel.from_pretrained(mtp_target("llama", "deepseek"), MTPConfig(num_nextn_predict_layers=1,
                                         max_draft_len=3), dtype=torch.bfloat16, device="cuda", max_batch_size=16,
                                         enforce_eager=eager, compile_step=True)
    rule, taken = layers.few_row_kernels, set()

    def recorded(x, attn, *bound):
        taken.add(rule(x, attn, *bound))
        return rule(x, attn, *bound)
    monkeypatch.setattr(layers, "few_row_kernels", recorded)
    monkeypatch.setenv(trace_cache.TRACE_CACHE_VAR, "0")  # traced here, with the patch: not loaded from disk
    torch._dynamo.reset()  # nor reused from an earlier test in this process: a trace made while traces were cached
    # has no guard on the patched function's identity (trace_cache.py), so it would run the unpatched one
    fast, eager = build(False), build(True)
    batches, params = ([PROMPTS[0]], [PROMPTS[2]], PROMPTS[:2], (PROMPTS * 2)[:9]), SamplingParams(max_new_tokens=24)
    fast_tokens = [[o.token_ids for o in fast.generate(prompts, params)] for prompts in batches]
    assert taken == {True, False}  # the compiled steps traced both paths (batches 1 and 2; batch 9)
    assert fast_tokens == [[o.token_ids for o in eager.generate(prompts, params)] for prompts in batches]


@pytest.mark.compiles
# each worker and each acceptance once: every case compiles its own step (tens of seconds)
@pytest.mark.parametrize("spec,rejection", [("eagle3", False), ("mtp", True), ("none", False)])
def test_compiled_step_is_one_graph_with_flashinfer_sampling(spec, rejection, monkeypatch):
    """The default step compiled whole traces FlashInfer's samplers (torch custom ops) without a graph break
    (but the layer stack's, by design), and one dynamic compilation serves every bucket above 1 of a sampling
    variant: batches 3, 5 and 8 compile nothing after batches 1 and 2."""
    assert flashinfer_ops.available(torch.device("cuda")), "the GPU suite needs flashinfer (.devkit)"
    monkeypatch.setenv(trace_cache.TRACE_CACHE_VAR, "0")  # traced here, not loaded from an earlier test's traces
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    vocab = flashinfer_ops.MIN_VOCAB  # smaller vocabularies sample on the torch path
    if spec == "mtp":
        config = MTPConfig(num_nextn_predict_layers=1, max_draft_len=3, use_rejection_sampling=rejection)
        model = SpecModel.from_pretrained(mtp_target("llama", "deepseek", vocab), config, dtype=torch.float32,
                                          device="cuda", max_batch_size=8, compile_step=True)
    else:
        target, head = tiny_pair("llama", vocab_size=vocab)
        config = eagle3(head, 3).model_copy(update={"use_rejection_sampling": rejection}) if spec == "eagle3" else None
        model = SpecModel.from_pretrained(target, config, dtype=torch.float32, device="cuda", max_batch_size=8,
                                          compile_step=True)
    assert model.runner.compiles_step_whole and model.runner.graph_runner.step is not generation_step
    assert model.worker.use_flashinfer
    graphs = {}
    for size in (1, 2, 3, 5, 8):
        model.generate(PROMPTS[:size] + PROMPTS[:max(0, size - len(PROMPTS))],
                       SamplingParams(max_new_tokens=6, temperature=0.8, top_k=20), seed=size)
        graphs[size] = counters["stats"]["unique_graphs"]
    assert not breaks_elsewhere(counters["graph_break"]), dict(counters["graph_break"])
    assert graphs[1] > 0 and graphs[8] == graphs[2], graphs
    torch._dynamo.reset()


def test_graphs_are_keyed_by_bucket_draft_lens_and_all_greedy():
    target, model = _model("llama", 3, torch.float32, eager=False, compile_step=False)
    outs = model.generate(PROMPTS, [SamplingParams(max_new_tokens=n) for n in MAX_NEW])
    graphs = model.runner.graph_runner.graphs
    assert graphs and all(key[3] for key in graphs)  # argmax graphs only
    for p, n, out in zip(PROMPTS, MAX_NEW, outs):
        assert out.token_ids == hf_greedy(target, p, n)
    mixed = [SamplingParams(max_new_tokens=n, temperature=0.0 if i % 2 else 0.9) for i, n in enumerate(MAX_NEW)]
    outs = model.generate(PROMPTS, mixed, seed=1)
    assert {key[3] for key in model.runner.graph_runner.graphs} == {False, True}
    for i, (p, n, out) in enumerate(zip(PROMPTS, MAX_NEW, outs)):
        if i % 2:
            assert out.token_ids == hf_greedy(target, p, n)  # greedy rows exact inside the sampling graph


@pytest.mark.parametrize("rejection", [False, True])
def test_draft_len_schedule_in_graphs_equals_eager(rejection, monkeypatch):
    """A schedule that changes the draft length with every batch size (0 drafts at 4+ requests): the graphed
    step gives the eager tokens (greedy: also HF's in fp32), and its graphs carry the draft lengths.
    Run ahead, a batch's new size takes effect one step later (README), so sampled rows draw after other drafts
    than eager's: there the greedy rows are checked against HF, and the comparison with eager runs one step at a
    time."""
    schedule = {1: 3, 2: 2, 3: 1, 4: 0}
    target, head = tiny_pair("llama")
    config = eagle3(head, 3).model_copy(update={"draft_len_schedule": schedule,
                                                "use_rejection_sampling": rejection})
    models = [SpecModel.from_pretrained(target, config, dtype=torch.float32, device="cuda", max_batch_size=4,
                                        enforce_eager=eager, compile_step=False) for eager in (False, True)]
    # sampled rows carry their own seeds: the request that joins mid-run is prefilled beside the graphed decoders,
    # where rows of the batch stream would draw other numbers than in eager's one step over the whole batch
    sampled = [rejection and i % 2 == 0 for i in range(len(MAX_NEW))]
    params = [SamplingParams(max_new_tokens=n, temperature=0.9 if s else 0.0, seed=40 + i if s else None)
              for i, (n, s) in enumerate(zip(MAX_NEW, sampled))]
    launched = count_steps_run_ahead(monkeypatch)
    for i, (p, n, out) in enumerate(zip(PROMPTS, MAX_NEW, models[0].generate(PROMPTS, params, seed=3))):
        if params[i].is_greedy:
            assert out.token_ids == hf_greedy(target, p, n)
    assert launched[0] > 0
    monkeypatch.setattr(CUDAGraphRunner, "can_run_next", lambda self: False)
    graphed, eager = (m.generate(PROMPTS, params, seed=3) for m in models)
    for i, (p, n, x, y) in enumerate(zip(PROMPTS, MAX_NEW, graphed, eager)):
        assert x.token_ids == y.token_ids
        if params[i].is_greedy:
            assert x.token_ids == hf_greedy(target, p, n)
    keys = models[0].runner.graph_runner.graphs
    assert {(size, k) for size, k, next_k, *_ in keys if k == next_k} >= {(1, 3), (2, 2), (4, 1), (4, 0)}
    assert any(k != next_k for _, k, next_k, *_ in keys)  # a step that changed the length replayed its own graph


def test_a_graph_captured_mid_generation_leaves_the_requests_state_alone():
    """A step that changes the draft length captures its graph during generation; its warm-up steps must run on
    padding rows: the real requests' draft distributions (what the replay verifies against) stay as they were."""
    target, head = tiny_pair("llama")
    config = eagle3(head, 3).model_copy(update={"draft_len_schedule": {1: 3, 2: 2, 3: 1, 4: 0},
                                                "use_rejection_sampling": True})
    model = SpecModel.from_pretrained(target, config, dtype=torch.float32, device="cuda", max_batch_size=4,
                                      compile_step=False)
    runner, real = model.runner.graph_runner, torch.arange(5, device="cuda") != model.runner.kv_cache.padding_slot
    capture, moved = runner._capture, []

    def checked(size, draft_len):
        before = model.worker.draft_probs[real].clone()
        graph = capture(size, draft_len)
        moved.append(not torch.equal(before, model.worker.draft_probs[real]))
        return graph

    runner._capture = checked
    model.generate(PROMPTS, [SamplingParams(max_new_tokens=n, temperature=0.9) for n in MAX_NEW], seed=2)
    assert len(moved) > len(runner._bucket_draft_lens())  # some graphs were captured during generation
    assert not any(moved)


@pytest.mark.parametrize("vanilla", [False, True])
def test_mtp_graphed_greedy_is_lossless_fp32(vanilla):
    """MTP (modules on fused layers) in CUDA graphs: greedy output equals HF generate."""
    target = mtp_target("qwen2", "mimo")
    config = (MTPConfig(num_nextn_predict_layers=3, use_mtp_vanilla=True) if vanilla
              else MTPConfig(num_nextn_predict_layers=1, max_draft_len=3))
    model = SpecModel.from_pretrained(target, config, dtype=torch.float32, device="cuda", max_batch_size=8,
                                      compile_step=False)
    outs = model.generate(PROMPTS, [SamplingParams(max_new_tokens=n) for n in MAX_NEW])
    assert model.runner.graph_runner.graphs and all(isinstance(m.block, DecoderLayer)
                                             for m in model.worker.draft_model.mtp_modules)
    for p, n, out in zip(PROMPTS, MAX_NEW, outs):
        assert out.token_ids == hf_greedy(target, p, n)


@pytest.mark.parametrize("spec", ["eagle3", "none"])
def test_run_ahead_equals_one_step_at_a_time(spec, monkeypatch):
    """The graphed engine in bf16 launches each steady step before the host reads the one before; greedy and
    seeded sampled requests (three slots for five, a stop token mid-run) decode exactly as with one step at a
    time, with the same acceptance. (The compiled step runs ahead in tests/gpu/test_logprobs_gpu.py.)"""
    target, head = tiny_pair("llama")
    model = SpecModel.from_pretrained(target, eagle3(head, 3) if spec == "eagle3" else None, dtype=torch.bfloat16,
                                      device="cuda", max_batch_size=3, compile_step=False)
    params = [SamplingParams(max_new_tokens=40 + 5 * i, temperature=0.0 if i % 2 else 0.8, seed=i)
              for i in range(len(PROMPTS))]
    first = model.generate(PROMPTS, params, seed=1)
    stop = first[1].token_ids[9]
    params[1] = params[1].model_copy(update={"stop_token_ids": [stop]})
    launched = count_steps_run_ahead(monkeypatch)
    ahead = model.generate(PROMPTS, params, seed=1)
    assert launched[0] > 20
    monkeypatch.setattr(CUDAGraphRunner, "can_run_next", lambda self: False)
    in_step = model.generate(PROMPTS, params, seed=1)
    assert [o.token_ids for o in ahead] == [o.token_ids for o in in_step]
    assert [o.stats for o in ahead] == [o.stats for o in in_step]
    assert ahead[1].finish_reason == "stop"


@pytest.mark.compiles
def test_warmup_leaves_no_capture_for_greedy_sampled_or_seeded_requests():
    target, head = tiny_pair("llama")
    model = SpecModel.from_pretrained(target, eagle3(head, 3), dtype=torch.float32, device="cuda", max_batch_size=4,
                                      compile_step=True)
    held = model.warmup()
    assert held >= 3 * len(model.runner.graph_runner.buckets)
    kinds = [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=12, temperature=0.8),
             SamplingParams(max_new_tokens=12, temperature=1.0, top_k=5, seed=3)]
    for size in range(1, 5):
        model.generate([[3, 5, 7 + i] for i in range(size)], [kinds[i % 3] for i in range(size)])
    assert len(model.runner.graph_runner.graphs) == held


def test_warmup_waits_for_flashinfers_build_before_the_first_sampled_graph_only(monkeypatch):
    """While FlashInfer's sampling JIT build runs, the warm-up captures the graphs that do not need it (greedy;
    seeded rows sample on the torch path), then names the wait on its bar and waits, before the first sampled one."""
    from tllm_spec.engine.cuda_graphs import variant_name

    target, head = tiny_pair("llama", vocab_size=flashinfer_ops.MIN_VOCAB)  # sampled through FlashInfer
    model = SpecModel.from_pretrained(target, eagle3(head, 3), dtype=torch.float32, device="cuda", max_batch_size=8,
                                      compile_step=False)
    runner, waits = model.runner.graph_runner, []
    monkeypatch.setattr(flashinfer_ops, "sampling_build_running", lambda: not waits)
    monkeypatch.setattr(flashinfer_ops, "wait_sampling_build",
                        lambda: waits.append({variant_name(key[3:]) for key in runner.graphs}))
    model.warmup()
    assert waits and waits[0] == {"greedy", "seeded"}
    assert {variant_name(key[3:]) for key in runner.graphs} == {"greedy", "seeded", "sampled"}


def test_the_embedded_demo_captures_its_eager_step_and_samples_without_flashinfer():
    """compile_step="auto" and the sampler's vocabulary rule: the demo pair (8M parameters, 4096 tokens) is ready
    without a torch.compile or FlashInfer's JIT build, and its sampled output follows its seeds as before."""
    from tllm_spec import Eagle3Config

    model = SpecModel.from_pretrained("demo://target", Eagle3Config(speculative_model="demo://eagle3"),
                                      device="cuda", max_batch_size=4)
    assert model.runner.graph_runner.step is generation_step and not model.worker.use_flashinfer
    model.warmup()
    params = SamplingParams(max_new_tokens=16, temperature=0.8, seed=3)
    outs = model.generate([[5, 17, 3], [12, 8]], params)
    assert outs[0].token_ids == model.generate([[5, 17, 3]], params)[0].token_ids and len(outs[1].token_ids) == 16
