"""What a device offers the kernels: whether the Triton kernels run there, its SM count, and the one rule by
which a stage resolves its `backend` setting ("auto", "triton", "torch", ...) to what runs."""
from __future__ import annotations

import functools
import os

import torch

from sift.errors import SiftError


def triton_runs_on(device) -> bool:
    """The Triton kernels run on CUDA devices, and on any device under the Triton interpreter
    (TRITON_INTERPRET=1: tests on CPU)."""
    return torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device (the current one when the device has no index); read once."""
    device = torch.device(device)
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def resolve_backend(name: str, device, *, choices: tuple[str, ...], setting: str = "backend") -> str:
    """A stage's backend setting -> the backend that runs on `device`: "auto" is "triton" on CUDA and "torch"
    elsewhere; "triton" off CUDA needs the Triton interpreter. choices: the names the stage takes (its
    user-facing names, recorded in indexes: runtime/backends.py says what each runs); setting: how the user
    wrote the setting, for the one-line refusal."""
    if name not in choices:
        raise SiftError(f"{setting}={name!r} must be one of {', '.join(choices)}")
    if name == "auto":
        return "triton" if torch.device(device).type == "cuda" else "torch"
    if name == "triton" and not triton_runs_on(device):
        raise SiftError(f"{setting}='triton' needs a CUDA device (or TRITON_INTERPRET=1): use {setting}='auto' or "
                        f"'torch' on CPU")
    return name


def upload(x: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device's queued work: on a GPU through pinned memory,
    asynchronously (a pageable copy would wait for the stream)."""
    device = torch.device(device)
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)
