"""kernels/device.py: the one backend resolution both stages use, and the SM count the kernels size grids by."""
from types import SimpleNamespace

import pytest
import torch

from sift.errors import SiftError
from sift.kernels import device as dev

ENGINE = ("auto", "triton", "torch", "reference")
BUILDER = ("auto", "torch", "triton")


def test_resolve_backend(monkeypatch):
    assert dev.resolve_backend("auto", "cpu", choices=ENGINE) == "torch"
    assert dev.resolve_backend("auto", torch.device("cuda", 1), choices=BUILDER) == "triton"
    assert dev.resolve_backend("reference", "cpu", choices=ENGINE) == "reference"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dev.resolve_backend("triton", "cpu", choices=BUILDER) == "triton"  # the interpreter runs the kernels
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(SiftError, match=r"^build\.backend='triton' needs a CUDA device .*'auto' or 'torch' on CPU"):
        dev.resolve_backend("triton", "cpu", choices=BUILDER, setting="build.backend")
    with pytest.raises(SiftError, match=r"^backend='reference' must be one of auto, torch, triton$"):
        dev.resolve_backend("reference", "cpu", choices=BUILDER)


def test_sm_count_reads_each_device_once(monkeypatch):
    calls = []

    def properties(index):
        calls.append(index)
        return SimpleNamespace(multi_processor_count=100 + index)

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    dev._sm_count.cache_clear()
    try:
        assert dev.sm_count(torch.device("cuda", 1)) == 101 and dev.sm_count("cuda:1") == 101
        assert dev.sm_count("cuda") == 103  # no index: the current device
        assert calls == [1, 3]
    finally:
        dev._sm_count.cache_clear()
