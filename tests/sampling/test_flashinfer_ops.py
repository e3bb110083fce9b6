"""The flashinfer wrapper: lazy import, one version check, one warning, then the torch path."""
import sys
import types
import warnings

import pytest
import torch

from tllm_spec.sampling import flashinfer_ops


@pytest.fixture
def fresh_loader():
    flashinfer_ops.load_flashinfer.cache_clear()
    yield
    flashinfer_ops.load_flashinfer.cache_clear()


def _install_fake(monkeypatch, version: str) -> types.ModuleType:
    fake = types.ModuleType("flashinfer")
    fake.__version__ = version
    fake.sampling = types.ModuleType("flashinfer.sampling")
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setitem(sys.modules, "flashinfer.sampling", fake.sampling)
    return fake


def _load_twice() -> tuple[object, object, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = flashinfer_ops.load_flashinfer()
        second = flashinfer_ops.load_flashinfer()
        usable = flashinfer_ops.available(torch.device("cuda"))
    assert usable == (first is not None)
    return first, second, caught


@pytest.mark.parametrize("version", ["0.6.3", "0.2.14.post1", "", "nightly"])
def test_too_old_warns_once_and_falls_back(monkeypatch, fresh_loader, version):
    _install_fake(monkeypatch, version)
    first, second, caught = _load_twice()
    assert first is None and second is None
    assert len(caught) == 1 and "older than 0.7" in str(caught[0].message)
    assert "torch path" in str(caught[0].message)


def test_missing_warns_once_and_falls_back(monkeypatch, fresh_loader):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` raise ImportError
    first, second, caught = _load_twice()
    assert first is None and second is None
    assert len(caught) == 1 and "cannot be imported" in str(caught[0].message)


@pytest.mark.parametrize("version", ["0.7.0", "0.7.2.post1", "1.0.0rc1"])
def test_new_enough_is_used_without_warning(monkeypatch, fresh_loader, version):
    fake = _install_fake(monkeypatch, version)
    first, second, caught = _load_twice()
    assert first is fake and second is fake
    assert not caught


def test_cpu_tensors_never_import_flashinfer(monkeypatch, fresh_loader):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not flashinfer_ops.available(torch.device("cpu"))
    assert flashinfer_ops.load_flashinfer.cache_info().currsize == 0


def test_parse_version():
    assert flashinfer_ops.parse_version("0.7.2.post1") == (0, 7)
    assert flashinfer_ops.parse_version("12.34rc1") == (12, 34)
    assert flashinfer_ops.parse_version("dev") == (0, 0)
