"""Shared test utilities: the device the Triton kernels run on, the real SmolLM2 weights (loaded once per
process), the embedded sample data, and float tolerances derived from the dtype and the depth of the computation."""
import copy
import functools
import json
import math
import threading

import torch

from sift.pipeline.corpus import SAMPLE_CORPUS


# The device of every test that launches a Triton kernel: the GPU where there is one, else the CPU, where the
# kernels run in the Triton interpreter (TRITON_INTERPRET=1, set by tests/conftest.py). Inputs are drawn on the
# CPU from seeded generators and then moved, so both devices see the same values; the torch references stay on
# the CPU (fp32 / float64) and the kernels' results come back with .cpu() before they are compared.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on_device(*xs):
    """The tensors on DEVICE (None stays None), as a list."""
    return [None if x is None else x.to(DEVICE) for x in xs]


def model_on_device(model):
    """`model` on DEVICE: the model itself where it is there already (the CPU), else a copy, so that a test can
    compare the copy's run (Triton kernels) with the original's (torch backend, CPU)."""
    if next(model.parameters()).device.type == torch.device(DEVICE).type:
        return model
    return copy.deepcopy(model).to(DEVICE)


@functools.lru_cache(maxsize=None)
def _load(attn_implementation: str):
    from sift.model import DEFAULT_MODEL, load_model

    model, tokenizer, _ = load_model(DEFAULT_MODEL, attn_implementation=attn_implementation)
    return model, tokenizer


def smollm2(attn_implementation: str = "sdpa"):
    """(model, tokenizer) of the real SmolLM2-135M-Instruct, fp32 on CPU. Shared: do not mutate weights."""
    return _load(attn_implementation)


def wiki_texts(count: int, step: int = 37) -> list[str]:
    """Real Wikipedia leads from the embedded sample corpus."""
    lines = (SAMPLE_CORPUS / "wiki_vital_leads.jsonl").read_text().splitlines()
    return [json.loads(line)["text"] for line in lines[::step][:count]]


def run_in_threads(worker, n: int) -> None:
    """Run worker(k) for k < n on n threads at once; re-raise the first exception any of them raised."""
    errors = []

    def guarded(k: int) -> None:
        try:
            worker(k)
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


# --------------------------------------------------------------------------------------------- float tolerances
#
# Two computations of the same values that differ only in rounding (another summation order because another
# matrix shape makes the BLAS pick another kernel, a fused op against separate ones, angles formed in fp64
# against fp32) differ by rounding noise whose pattern depends on the CPU and its BLAS. A tolerance is
# therefore derived from the dtype and the depth of the computation, never taken from one machine's result:
#
#   one rounding moves a value by at most eps/2 of its magnitude; a reduction of n terms rounds n times, and in
#   two different orders the roundings are independent, so the results differ by a random walk of ~sqrt(n)
#   roundings of the result's magnitude; through `depth` sequential layers (each adds its output to a residual
#   stream) independent errors add in quadrature, ~sqrt(depth). The largest of many compared values lands a few
#   standard deviations out: SIGMAS.
#
# The result is far below what a real defect moves (a skipped or misplaced key block, a wrong rotation, a stale
# page change values by 1e-2 of their magnitude or more), so a derived tolerance still fails on every such bug.

SIGMAS = 4.0


def rounding_tol(dtype: torch.dtype, *, scale: float = 1.0, reduction: int = 1, depth: int = 1) -> float:
    """SIGMAS * eps(dtype) * sqrt(reduction * depth) * scale: the largest difference expected between two
    roundings of the same computation. scale: the magnitude of the compared values (max |x|); reduction: the
    longest sum that forms one value in one layer; depth: the layers in sequence."""
    return SIGMAS * torch.finfo(dtype).eps * math.sqrt(max(1, reduction) * max(1, depth)) * float(scale)


def model_rounding(config, depth: int | None = None) -> float:
    """Relative rounding difference of a value after `depth` layers (default: all) of a transformers decoder
    computed two ways in fp32 (another batch shape, stored pages against an in-context forward, SIFT's
    segment-local rotation against the plain forward): the reduction is the model's widest dot product (the
    MLP's down projection over intermediate_size, or hidden_size), the depth its layers."""
    width = max(config.hidden_size, getattr(config, "intermediate_size", 0) or 0)
    return rounding_tol(torch.float32, reduction=width, depth=depth or config.num_hidden_layers)


def model_logit_tol(config, reference: torch.Tensor) -> float:
    """Tolerance on fp32 logits of a model computed two ways: `model_rounding` at the reference logits' scale."""
    return model_rounding(config) * reference.abs().max().item()


def kernel_tol(dtype: torch.dtype, *, roundings: int, reduction: int, scale: float = 1.0) -> float:
    """A kernel that takes `dtype` tensors and accumulates in fp32, against a float64 reference: `roundings`
    values rounded to `dtype` on the way (inputs the reference sees unrounded, a rotated tile, the probabilities,
    the output), independent, plus fp32 accumulation over `reduction` terms; scale: the output's magnitude."""
    eps, eps32 = torch.finfo(dtype).eps, torch.finfo(torch.float32).eps
    return SIGMAS * float(scale) * (eps * math.sqrt(roundings) + eps32 * math.sqrt(reduction))


def assert_within(got: torch.Tensor, want: torch.Tensor, tol: float, what: str = "") -> None:
    """max |got - want| <= tol, the error printed first (run with -s to see it)."""
    err = (got.double().cpu() - want.double().cpu()).abs().max().item()
    print(f"{what}: max |diff| = {err:.2e} (tolerance {tol:.2e})")
    assert err <= tol, f"{what}: max |diff| {err:.3e} > tolerance {tol:.3e}"
