"""The compiled step's Dynamo traces kept on disk (tllm_spec.trace_cache): a second process loads them and
traces nothing, a third that needs a variant the first never compiled traces only that one, and every step
equals the eager step. Real processes (TLLM_SPEC_TRACE_CACHE=1), Inductor on the CPU, one cache directory."""
import contextlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tllm_spec import SamplingParams
from tllm_spec import trace_cache
from tllm_spec.engine.cuda_graphs import compiled_generation_step, generation_step, step_compile_settings
from tllm_spec.spec_model import SpecModel

from .models import eagle3, tiny_pair

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"greedy": SamplingParams(), "sampled": SamplingParams(temperature=0.8, top_k=20),
            "seeded": SamplingParams(temperature=0.9, seed=5)}


def child(variants: list[str]) -> dict:
    """Compiled steps of a tiny EAGLE-3 pair at batch 1, 2 and 3 for each of ``variants``, each against the eager
    step; what was traced, loaded and saved."""
    from torch._dynamo.utils import counters

    target, head = tiny_pair("qwen3")
    model = SpecModel.from_pretrained(target, eagle3(head, 3), dtype=torch.float32, max_batch_size=3)
    k, metadata = model.max_draft_len, model.runner.spec_metadata
    modules = (model.runner.model, model.runner.kv_cache)
    compiled, equal = compiled_generation_step(), []
    for name in variants:
        for size in (1, 2, 3):
            metadata.prepare([VARIANTS[name]] * size, (), k, k)
            inputs = (torch.arange(size * (k + 1)) % 90, torch.arange(k + 1).repeat(size) + 6,
                      torch.arange(size).repeat_interleave(k + 1), (torch.arange(size * k) % 7).view(size, k))
            outs = []
            for step in (compiled, generation_step):
                metadata.reseed(0)
                with torch.inference_mode(), step_compile_settings():
                    outs.append(step(*modules, *inputs))
            equal.append(torch.equal(*outs))
    return {"equal": equal, "traced": counters["stats"]["unique_graphs"],
            "loaded": counters["dynamo_cache"]["dynamo_cache_hit"], "saved": trace_cache.save()}


def child_two_models() -> dict:
    """A model without speculation and an EAGLE-3 model on one target, each engine with its own compiled step (as
    scripts/benchmark.py builds them), each step against the eager one."""
    from torch._dynamo.utils import counters

    target, head = tiny_pair("llama")
    spec = SpecModel.from_pretrained(target, eagle3(head, 3), dtype=torch.float32, max_batch_size=2)
    plain = SpecModel.from_target(spec.target, None, max_batch_size=2)
    equal = []
    for model in (plain, spec):
        compiled, k, metadata = compiled_generation_step(), model.max_draft_len, model.runner.spec_metadata
        modules = (model.runner.model, model.runner.kv_cache)
        for size in (1, 2):
            metadata.prepare([SamplingParams()] * size, (), k, k)
            inputs = (torch.arange(size * (k + 1)) % 90, torch.arange(k + 1).repeat(size) + 6,
                      torch.arange(size).repeat_interleave(k + 1), (torch.arange(size * k) % 7).view(size, k))
            with torch.inference_mode(), step_compile_settings():
                equal.append(torch.equal(compiled(*modules, *inputs), generation_step(*modules, *inputs)))
    return {"equal": equal, "traced": counters["stats"]["unique_graphs"],
            "loaded": counters["dynamo_cache"]["dynamo_cache_hit"], "saved": trace_cache.save()}


def _run(variants: list[str] | None, cache: Path, **env) -> dict:
    call = f"child({variants!r})" if variants is not None else "child_two_models()"
    code = f"import json; from tests.test_trace_cache import child, child_two_models; print(json.dumps({call}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache),
                               trace_cache.TRACE_CACHE_VAR: "1", **env})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "is dropped with caching_precompile" not in done.stderr  # torch's warning per left-out guard, filtered
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # real processes that torch.compile on the CPU: minutes
@pytest.mark.skipif(not hasattr(torch._dynamo.config, "caching_precompile"), reason="this torch has no DynamoCache")
def test_a_second_process_loads_the_steps_traces_and_traces_only_what_is_new(tmp_path):
    first = _run(["greedy"], tmp_path)
    assert all(first["equal"]) and first["traced"] > 0 and first["loaded"] == 0 and first["saved"]
    assert any((tmp_path / "dynamo").iterdir())
    second = _run(["greedy", "sampled"], tmp_path)  # greedy loaded; sampled traced after the load, no name clash
    assert all(second["equal"]) and second["loaded"] > 0 and 0 < second["traced"] < first["traced"] and second["saved"]
    third = _run(["greedy", "sampled"], tmp_path)
    assert all(third["equal"]) and third["loaded"] > 0 and third["traced"] == 0
    off = _run(["greedy"], tmp_path, **{trace_cache.TRACE_CACHE_VAR: "0"})  # off: traces again
    assert all(off["equal"]) and off["loaded"] == 0 and off["traced"] > 0 and not off["saved"]


@pytest.mark.slow  # real processes that torch.compile on the CPU: minutes
@pytest.mark.skipif(not hasattr(torch._dynamo.config, "caching_precompile"), reason="this torch has no DynamoCache")
def test_two_models_steps_in_one_process_share_one_package(tmp_path):
    """Two compiled-step wrappers in one process once failed: the second's package could not name the resume
    functions (after the step's graph breaks) that the first one's traces made (torch's PackageError)."""
    first = _run(None, tmp_path)
    assert first["equal"] == [True] * 4 and first["traced"] > 0 and first["saved"]
    second = _run(None, tmp_path)
    assert second["equal"] == [True] * 4 and second["loaded"] > 0 and second["traced"] == 0


def _plus_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@pytest.mark.slow  # ten seconds or more on the 2-core CI machine: the second CI command runs it
@pytest.mark.skipif(not hasattr(torch._dynamo.config, "caching_precompile"), reason="this torch has no DynamoCache")
def test_a_package_that_fails_to_load_is_deleted_and_traced_afresh(tmp_path, monkeypatch):
    """torch raising while it installs a saved package's guards does not fail the compile: tllm_spec warns, deletes
    the package and traces the function again."""
    from torch._dynamo.package import CompilePackage, DynamoCache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(trace_cache.TRACE_CACHE_VAR, "1")
    trace_cache.reset()
    x = torch.arange(4.0)
    with trace_cache.caching(), torch.inference_mode():
        assert torch.equal(trace_cache.compile(_plus_one, backend="inductor")(x), x + 1)
    assert trace_cache.save()
    package = Path(DynamoCache.path_prefix()) / CompilePackage.source_id_from_fn(_plus_one)
    assert package.is_dir()
    trace_cache.reset()

    def broken(self, backends):
        raise TypeError("'NoneType' object is not subscriptable")  # as a guard on a patched closure did

    monkeypatch.setattr(CompilePackage, "install", broken)
    with pytest.warns(UserWarning, match="could not be loaded"):
        compiled = trace_cache.compile(_plus_one, backend="inductor")
    assert not package.exists()
    with trace_cache.caching(), torch.inference_mode():
        assert torch.equal(compiled(x), x + 1)
    trace_cache.reset()


def _view(x: torch.Tensor) -> torch.Tensor:
    return x[...]  # a traced region without a single operation


@pytest.mark.skipif(not hasattr(torch._dynamo.config, "caching_precompile"), reason="this torch has no DynamoCache")
def test_a_region_without_operations_compiles_while_caching(tmp_path, monkeypatch):
    """A compiled region that only returns a view of its input failed inside the DynamoCache with 'expected
    OutputCode, got <class 'method'>' (the second model of a process on an H100; here on the CPU) until
    :func:`trace_cache.caching` bundled AOTAutograd's entries; no fallback is needed for it."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(trace_cache.TRACE_CACHE_VAR, "1")
    trace_cache.reset()
    x = torch.arange(4.0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="tllm_spec")  # a fallback would warn
        with trace_cache.caching(), torch.inference_mode():
            assert torch.equal(trace_cache.compile(_view, backend="inductor", dynamic=True)(x), x)
    assert trace_cache.enabled() and trace_cache.save()
    trace_cache.reset()


@pytest.mark.slow  # compiles two regions with Inductor: eight to ten seconds on the 2-core machine
@pytest.mark.skipif(not hasattr(torch._dynamo.config, "caching_precompile"), reason="this torch has no DynamoCache")
def test_a_failure_inside_the_cache_falls_back_to_a_plain_compile_with_one_warning(tmp_path, monkeypatch):
    """Whatever fails inside the experimental cache never reaches the user: here the cache runs without the
    setting that the region above needs, so compiling it fails inside the cache; the call still returns the right
    result, one warning names TLLM_SPEC_TRACE_CACHE, and the cache is off for every wrapper from then on."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(trace_cache.TRACE_CACHE_VAR, "1")
    monkeypatch.setattr(trace_cache, "_bundled_entries", contextlib.nullcontext)
    trace_cache.reset()
    x = torch.arange(4.0)
    view, plus_one = (trace_cache.compile(f, backend="inductor", dynamic=True) for f in (_view, _plus_one))
    with pytest.warns(UserWarning, match=f"failed inside the trace cache.*{trace_cache.TRACE_CACHE_VAR}=0") as seen:
        with trace_cache.caching(), torch.inference_mode():
            assert torch.equal(view(x), x)
            assert torch.equal(view(x + 1), x + 1) and torch.equal(plus_one(x), x + 1)
    assert len([w for w in seen if "trace cache" in str(w.message)]) == 1
    assert "expected OutputCode" in str(seen[0].message)
    assert not trace_cache.enabled() and not trace_cache.save()
    trace_cache.reset()
    assert trace_cache.enabled()
