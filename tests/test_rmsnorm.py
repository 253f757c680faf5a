"""The one-kernel RMSNorm of the decode step (kernels/rmsnorm.py) and where the runner uses it (runtime/runner.py
`fusable_norms`): the kernel (on tests/helpers.py DEVICE: the GPU, or the Triton interpreter on CPU) against
RMSNorm computed in float64 from its definition, the modules it stands in for and those it refuses, and decode with
it equal to decode without it."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from sift.kernels.rmsnorm import rms_norm, rms_norm_ref
from sift.runtime.runner import fusable_norms

from .helpers import DEVICE, model_on_device
from .test_engine import _tiny


def definition(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float64: w * x / sqrt(mean(x^2) + eps), no rounding."""
    x64 = x.double()
    return w.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                              (torch.float16, torch.float32)])
@pytest.mark.parametrize("shape", [(1, 576), (5, 100), (2, 3, 64)])
def test_kernel_matches_definition(x_dtype, w_dtype, shape):
    gen = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=gen) * 3).to(x_dtype)
    w = (1 + torch.randn(shape[-1], generator=gen) / 4).to(w_dtype)
    got = rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-6).cpu()
    assert got.dtype == torch.promote_types(w_dtype, x_dtype) and got.shape == x.shape
    want = definition(x, w, 1e-6)
    # Two roundings (the normalised row to x's dtype, the product to the output's), each at most half a unit of
    # its dtype, and the fp32 sum of squares over n terms (relative n * 2^-24, halved by the square root).
    n = shape[-1]
    u = lambda dt: torch.finfo(dt).eps / 2                          # noqa: E731
    bound = (u(x_dtype) + u(got.dtype) + n * 2.0**-24) * want.abs() + 1e-30
    assert ((got.double() - want).abs() <= bound * 1.01).all()
    twin = rms_norm_ref(x, w, 1e-6)
    assert twin.dtype == got.dtype
    assert ((twin.double() - want).abs() <= bound * 1.01).all()


def test_kernel_rejects_bad_inputs():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="one scale per column"):
        rms_norm(x.to(DEVICE), torch.ones(7).to(DEVICE), 1e-6)
    with pytest.raises(ValueError, match="float32 / float16 / bfloat16"):
        rms_norm(x.to(torch.float64).to(DEVICE), torch.ones(8, dtype=torch.float64).to(DEVICE), 1e-6)


class OnePlusRMSNorm(nn.Module):
    """Gemma's variant: the weight is an offset from one. `rms_norm` does not compute it."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n) / 4)
        self.variance_epsilon = 1e-6

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


def test_fusable_norms_takes_transformers_rmsnorms_and_refuses_a_variant(tmp_path):
    model = model_on_device(_tiny("llama", tmp_path))    # the check runs each class's module and the kernel
    found = fusable_norms(model, torch.device(DEVICE))
    layers = model.config.num_hidden_layers
    assert len(found) == 2 * layers + 1          # input and post-attention norms of every layer, the final norm
    assert all(type(m).__name__ == "LlamaRMSNorm" for m in found)
    model.model.norm = OnePlusRMSNorm(model.config.hidden_size).to(DEVICE)
    assert len(fusable_norms(model, torch.device(DEVICE))) == 2 * layers


def test_decode_with_the_fused_norms_equals_decode_without(tmp_path):
    """The engine's decode steps (backend triton, on DEVICE) with the model's norms as one kernel each: the same
    greedy tokens as with transformers' own norms, and the model's modules as they were afterwards."""
    from transformers import AutoTokenizer

    from sift.model import DEFAULT_MODEL, resolve_model_dir
    from sift.runtime import Request, SiftEngine

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(DEFAULT_MODEL))
    model = model_on_device(_tiny("qwen3", tmp_path))          # qwen3: the per-head q / k norms too
    r = Request("Hi.", [("a", "Lilu is a spirit of the night wind.")], "Lilu?")
    fused = SiftEngine(model, tokenizer, None, backend="triton")
    assert len(fused.runner.norms) == 4 * model.config.num_hidden_layers + 1
    plain = SiftEngine(model, tokenizer, None, backend="triton")
    plain.runner.norms = []
    a = fused.generate([r], max_new_tokens=4, mode="dense")
    b = plain.generate([r], max_new_tokens=4, mode="dense")
    assert a.token_ids == b.token_ids
    assert all("forward" not in vars(m) for m in fused.runner.norms)
