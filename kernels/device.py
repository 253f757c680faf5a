"""What a device offers the kernels: whether the Triton kernels run there, its SM count, whether its kernels
launch with programmatic dependent launch, and the one rule by which a stage resolves its `backend` setting
("auto", "triton", "torch", ...) to what runs."""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

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


@functools.cache
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def pdl_on(device) -> bool:
    """Whether the decode step's small kernels launch with programmatic dependent launch (PDL) on `device`: on
    CUDA devices of compute capability 9 or later (Hopper), compiled (not under the interpreter), unless
    SIFT_PDL=0. Such a kernel may be scheduled while the kernel before it in the stream drains: each program
    waits (`griddepcontrol.wait`, before its first load) for that kernel's completion and memory, and lets the
    next kernel be scheduled at once (`griddepcontrol.launch_dependents`). A decode step at one row is a chain
    of some 400 kernels of a few microseconds each, and the launch gap between two of them is what PDL hides."""
    device = torch.device(device)
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("SIFT_PDL") == "0":
        return False
    return _capability_major(device.index if device.index is not None else torch.cuda.current_device()) >= 9


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A kernel's first statement where it may launch with PDL (`pdl_on`): wait for the kernel before it, then
    let the next one be scheduled. Nothing when PDL is off (the interpreter never sees the instructions)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


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
