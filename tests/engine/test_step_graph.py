"""The generation step traces under torch.compile with no graph break but one, where the fused decoder hands its
layers to one compiled layer each (``FusedDecoder._compiled_layers``: one compilation serves every layer), for
every worker and for sampled steps on the torch path: the precondition for compiling the step whole (embedding,
acceptance, sampling and draft passes fused; one graph for every batch size), as CUDAGraphRunner does by default
on a fused single-GPU target (tests/gpu/test_engine_gpu.py checks the same with FlashInfer's samplers on the
GPU)."""
import pytest
import torch

from tllm_spec import DraftTargetConfig, MTPConfig, SAConfig, SamplingParams, trace_cache
from tllm_spec.engine.cuda_graphs import compiled_generation_step, generation_step, step_compile_settings
from tllm_spec.spec_model import SpecModel

from ..models import eagle3, tiny_pair
from ..test_mtp_lossless import mtp_target

BATCH = 5
TREES = {"eagle3_static_tree": {"max_draft_len": 2, "eagle_choices": [[0], [1], [0, 0], [0, 1], [1, 0]]},
         "eagle3_dynamic_tree": {"use_dynamic_tree": True, "dynamic_tree_max_topK": 2, "max_total_draft_tokens": 6}}
LAYER_STACK = "FusedDecoder._compiled_layers"  # the step's one graph break, by design


def breaks_elsewhere(reasons) -> list[str]:
    """The graph-break reasons (explain's, or the keys of Dynamo's graph_break counter) not at the layer stack."""
    return [str(reason) for reason in reasons if LAYER_STACK not in str(reason)]


@pytest.fixture(autouse=True)
def _fresh_dynamo(monkeypatch):
    """Each test starts and ends with empty Dynamo caches and counters, also when it fails, and traces in
    process (no traces loaded from disk: tllm_spec.trace_cache)."""
    monkeypatch.setenv(trace_cache.TRACE_CACHE_VAR, "0")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model(worker: str, rejection: bool) -> SpecModel:
    if worker.startswith("eagle3"):
        target, head = tiny_pair("qwen3")
        config = eagle3(head, 3).model_copy(update={"use_rejection_sampling": rejection, **TREES.get(worker, {})})
        return SpecModel.from_pretrained(target, config, dtype=torch.float32, max_batch_size=BATCH)
    if worker.startswith("mtp"):
        config = (MTPConfig(num_nextn_predict_layers=3, use_mtp_vanilla=True) if worker == "mtp_vanilla" else
                  MTPConfig(num_nextn_predict_layers=1, max_draft_len=3, use_rejection_sampling=rejection))
        return SpecModel.from_pretrained(mtp_target("llama", "deepseek"), config, max_batch_size=BATCH)
    target, head = tiny_pair("llama")
    spec = {"draft_target": DraftTargetConfig(speculative_model=str(target), max_draft_len=3,
                                              use_rejection_sampling=rejection),
            "sa": SAConfig(max_draft_len=4, enable_global_pool=True, global_pool_size=1024),
            "eagle3+sa": eagle3(head, 3).model_copy(update={"use_sa_spec": True, "use_rejection_sampling": rejection}),
            "plain": None}[worker]
    return SpecModel.from_pretrained(target, spec, dtype=torch.float32, max_batch_size=BATCH)


def _greedy_step_inputs(model: SpecModel, size: int, k: int) -> tuple[torch.Tensor, ...]:
    """Prepare a greedy generation step of ``size`` requests; its (ids, positions, slots, drafts)."""
    model.runner.spec_metadata.prepare([SamplingParams()] * size, (), k, k)
    ids = torch.arange(size * (k + 1)) % 90
    positions = torch.arange(k + 1).repeat(size) + 6
    slots = torch.arange(size).repeat_interleave(k + 1)
    return ids, positions, slots, (torch.arange(size * k) % 7).view(size, k)


def _step_modules(model):
    """The generation step's first arguments: the one-model module and its KV cache."""
    return model.runner.model, model.runner.kv_cache


@pytest.mark.slow  # eight to ten seconds a case on the 2-core machine (plain decoding too): the second CI command
@pytest.mark.parametrize("worker,temperature", [
    ("eagle3", 0.0), ("eagle3", 0.8), ("mtp", 0.8), ("mtp_vanilla", 0.0), ("plain", 0.0), ("draft_target", 0.0),
    ("draft_target", 0.8), ("sa", 0.8), ("eagle3+sa", 0.8), ("eagle3_static_tree", 0.0), ("eagle3_static_tree", 0.8),
    ("eagle3_dynamic_tree", 0.0), ("eagle3_dynamic_tree", 0.8)])
def test_generation_step_breaks_only_at_the_layer_stack(worker, temperature):
    model = _model(worker, rejection=temperature > 0)
    k = model.max_draft_len
    model.runner.spec_metadata.prepare([SamplingParams(temperature=temperature, top_k=20)] * BATCH, (), k, k)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 90, (BATCH * (k + 1),), generator=gen)
    positions = torch.arange(k + 1).repeat(BATCH) + 6
    slots = torch.arange(BATCH).repeat_interleave(k + 1)
    drafts = torch.randint(0, 90, (BATCH, k), generator=gen)
    with torch.inference_mode():
        explained = torch._dynamo.explain(generation_step)(*_step_modules(model), ids, positions, slots, drafts)
    elsewhere = breaks_elsewhere(b.reason for b in explained.break_reasons)
    assert explained.graph_break_count > 0 and not elsewhere, elsewhere
    assert explained.op_count > 0


@pytest.mark.slow  # compiles every batch bucket: seven seconds here, out of the README command for its margin
def test_one_compiled_step_serves_every_batch_size():
    """The batch size stays symbolic (SpecMetadata takes the request count from the drafts' shape): one
    compilation with dynamic shapes serves batch sizes 2, 3 and 5, and each call equals the eager step. (Batch 1
    is specialised, as Dynamo does for every size 1; duck sizing is off, as it must be wherever the step is
    compiled, so that batch 2 is not tied to the model's two KV heads.)"""
    model = _model("eagle3", rejection=False)
    k = model.max_draft_len
    compiled = compiled_generation_step(backend="eager")
    counters = torch._dynamo.utils.counters
    counters.clear()
    graphs = []
    for size in (2, 3, 5):
        inputs = _greedy_step_inputs(model, size, k)
        with torch.inference_mode(), step_compile_settings():
            assert torch.equal(compiled(*_step_modules(model), *inputs), generation_step(*_step_modules(model), *inputs))
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[-1] == graphs[0], graphs  # batch 3 and 5 compiled nothing more


def test_uniform_draws_the_eager_numbers_when_compiled():
    """Compiled, the counter-based draw is one opaque op in the graph (its 32-bit hash constants must not reach
    Inductor's int32 index arithmetic) and gives the eager numbers, for the batch stream and per-row streams."""
    from tllm_spec.sampling import rng

    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def draw(seed, offset, rows):
        return rng.uniform(seed, offset, (rows, 37), salt=3) * 2

    compiled = torch.compile(draw, fullgraph=True, dynamic=True, backend=recording_backend)
    for seed, offset in ((torch.tensor([5]), torch.tensor([9])), (torch.arange(4) + 2**40, torch.arange(4))):
        rows = 4 if seed.numel() > 1 else 3
        assert torch.equal(compiled(seed, offset, rows), draw(seed, offset, rows))
    targets = [node.target for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    assert torch.ops.tllm_spec.uniform.default in targets or torch.ops.tllm_spec.uniform in targets, targets
    assert torch.bitwise_xor not in targets and torch.ops.aten.bitwise_xor not in targets


@pytest.mark.slow  # compiles the step twice over: six seconds here, kept out of the README command for its margin
def test_a_new_forced_count_needs_no_recompilation():
    """TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS reaches the compiled step as a device value: forcing 1.5 then
    3 drafts is one compilation, and the second call accepts every draft."""
    model = _model("eagle3", rejection=False)
    k, size = model.max_draft_len, 3
    compiled = compiled_generation_step(backend="eager")
    counters = torch._dynamo.utils.counters
    counters.clear()
    lens, graphs = {}, []
    for forced in (1.5, 3.0):
        model.worker.forced_num_accepted = forced
        inputs = _greedy_step_inputs(model, size, k)
        with torch.inference_mode(), step_compile_settings():
            lens[forced] = compiled(*_step_modules(model), *inputs)[:, k + 1]  # new_tokens_lens
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[1] == graphs[0], graphs
    assert set(lens[1.5].tolist()) <= {2, 3} and lens[3.0].tolist() == [k + 1] * size


@pytest.mark.slow  # real processes or compiles: ten seconds or more (the second CI command)
@pytest.mark.parametrize("worker", ["eagle3", "plain"])  # K = 3 and K = 0 (MTP: the same OneModel code)
def test_a_step_with_logprobs_is_one_graph_and_compiles_to_the_eager_outputs(worker):
    """A step whose requests ask for logprobs (log-softmax, top-k, fp32 bits packed into int64 columns) traces
    without a graph break but the layer stack's, and compiled through AOT autograd (functionalised, as Inductor sees it) packs the eager
    step's columns bit for bit."""
    model = _model(worker, rejection=False)
    k, size = model.max_draft_len, 3
    _, positions, slots, drafts = _greedy_step_inputs(model, size, k)
    ids = torch.arange(size * (k + 1)) % 90
    params = [SamplingParams(logprobs=3), SamplingParams(), SamplingParams(temperature=0.8, logprobs=0)]
    model.runner.spec_metadata.prepare(params, (), k, k)
    assert model.runner.spec_metadata.logprobs_width == 5

    def run(step) -> torch.Tensor:
        model.runner.spec_metadata.reseed(0)  # the sampled row draws the same numbers each time
        with torch.inference_mode(), step_compile_settings():
            return step(*_step_modules(model), ids, positions, slots, drafts)

    with torch.inference_mode():
        explained = torch._dynamo.explain(generation_step)(*_step_modules(model), ids, positions, slots, drafts)
    assert not breaks_elsewhere(b.reason for b in explained.break_reasons)
    eager = run(generation_step)
    assert eager.shape == (size, 2 * k + 3 + (k + 1) * (1 + 5))
    assert torch.equal(run(compiled_generation_step(backend="aot_eager")), eager)
