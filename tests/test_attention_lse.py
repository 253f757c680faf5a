"""The forward-with-lse picker (`sift.kernels.attention_lse`) on CPU: the row check against an fp32 recomputation,
and the choice between backends, with the private SDPA ops replaced by fakes built on a dense reference written
here (the real cuDNN / flash ops need a GPU; bench/bench_profile.py checks them there).
"""
from __future__ import annotations

import pytest
import torch

from sift.kernels import attention_lse as al
from sift.kernels.numerics import LOG2E


def _dense(query, key, value, scale):
    """Dense causal attention in fp32: out [1, Hq, Lp, Dv] in query's dtype, lse [1, Hq, Lp] natural log."""
    g = query.shape[1] // key.shape[1]
    k = key.float().repeat_interleave(g, dim=1)
    v = value.float().repeat_interleave(g, dim=1)
    s = query.float() @ k.transpose(-1, -2) * scale
    lp = query.shape[2]
    s = s.masked_fill(~torch.ones(lp, lp, dtype=torch.bool).tril(), float("-inf"))
    return (torch.softmax(s, dim=-1) @ v).to(query.dtype), torch.logsumexp(s, dim=-1)


def _inputs(hq=4, hkv=2, lp=37, d=16, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Views of [1, Lp, H, D], as a transformers forward hands them over.
    q = torch.randn(1, lp, hq, d, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(1, lp, hkv, d, generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(1, lp, hkv, d, generator=g).to(dtype).transpose(1, 2)
    return q, k, v, d ** -0.5


def test_check_rows_accepts_the_dense_result_and_names_errors():
    q, k, v, scale = _inputs()
    out, lse = _dense(q, k, v, scale)
    assert al.check_rows(q, k, v, out, lse[0], scale) is None
    msg = al.check_rows(q, k, v, out, lse[0] * LOG2E, scale)  # log2 units
    assert msg is not None and "lse" in msg
    msg = al.check_rows(q, k, v, out.flip(1), lse[0], scale)  # heads in the wrong order
    assert msg is not None and "output" in msg
    bad = lse[0].clone()
    bad[:, -1] = float("nan")
    assert al.check_rows(q, k, v, out, bad, scale) is not None


class _FakeOps:
    """Stands in for `attention_lse._run`: per source, 'ok', 'ok4d' (lse with a trailing 1), 'no_gqa' (raises
    unless K/V have the query heads), 'log2' (lse in log2 units), 'raise'."""

    def __init__(self, **modes):
        self.modes = modes
        self.calls = []

    def __call__(self, source, query, key, value, scale):
        mode = self.modes[source]
        self.calls.append((source, key.shape[1]))
        if mode == "raise" or (mode == "no_gqa" and key.shape[1] != query.shape[1]):
            raise RuntimeError(f"{source}: not supported\nsecond line")
        out, lse = _dense(query, key, value, scale)
        if mode == "ok4d":
            lse = lse[..., None]
        if mode == "log2":
            lse = lse * LOG2E
        return out, lse


@pytest.fixture
def fake(monkeypatch):
    def install(**modes):
        ops = _FakeOps(**modes)
        monkeypatch.setattr(al, "_run", ops)
        monkeypatch.setattr(al, "_may_run", lambda query: True)
        return ops
    return install


def test_auto_prefers_cudnn_and_checks_once_per_shape_class(fake, monkeypatch):
    ops = fake(cudnn="ok4d", flash="ok")
    checks = []
    real_check = al.check_rows
    monkeypatch.setattr(al, "check_rows", lambda *a: checks.append(1) or real_check(*a))
    fwd = al.AttentionWithLse("auto")
    q, k, v, scale = _inputs()
    out, lse = fwd(q, k, v, scale=scale)
    ref_out, ref_lse = _dense(q, k, v, scale)
    assert lse.shape == (4, 37) and lse.dtype == torch.float32
    torch.testing.assert_close(lse, ref_lse[0])
    assert torch.equal(out, ref_out)
    fwd(q, k, v, scale=scale)
    q2, k2, v2, _ = _inputs(lp=50, seed=1)  # same power-of-two bucket (32..63): no new check
    fwd(q2, k2, v2, scale=scale)
    assert len(checks) == 1 and {s for s, _ in ops.calls} == {"cudnn"}
    assert list(fwd.plans.values()) == [al.Plan("cudnn", False)]
    q3, k3, v3, _ = _inputs(lp=70, seed=2)  # next bucket: checked again
    fwd(q3, k3, v3, scale=scale)
    assert len(checks) == 2


def test_gqa_refused_natively_is_retried_with_expanded_kv(fake):
    ops = fake(cudnn="no_gqa", flash="ok")
    fwd = al.AttentionWithLse("auto")
    q, k, v, scale = _inputs(hq=6, hkv=2)
    with pytest.warns(UserWarning, match="expanded K/V"):
        out, lse = fwd(q, k, v, scale=scale)
    torch.testing.assert_close(lse, _dense(q, k, v, scale)[1][0])
    assert list(fwd.plans.values()) == [al.Plan("cudnn", True)]
    ops.calls.clear()
    fwd(q, k, v, scale=scale)
    assert ops.calls == [("cudnn", 6)]  # the plan goes straight to the expanded call


def test_wrong_lse_falls_back_to_flash_with_a_warning(fake):
    fake(cudnn="log2", flash="ok")
    fwd = al.AttentionWithLse("auto")
    q, k, v, scale = _inputs()
    with pytest.warns(UserWarning, match="WRONG RESULT"):
        _, lse = fwd(q, k, v, scale=scale)
    torch.testing.assert_close(lse, _dense(q, k, v, scale)[1][0])
    assert list(fwd.plans.values()) == [al.Plan("flash", False)]


def test_no_usable_backend(fake):
    fake(cudnn="raise", flash="log2")
    q, k, v, scale = _inputs()
    with pytest.warns(UserWarning, match="computes it"):
        assert al.AttentionWithLse("auto")(q, k, v, scale=scale) is None
    with pytest.raises(RuntimeError, match="'cudnn' unusable.*not supported"):
        al.AttentionWithLse("cudnn")(q, k, v, scale=scale)
    with pytest.raises(ValueError, match="lse source"):
        al.AttentionWithLse("math")


def test_cpu_and_fp32_need_no_backend():
    q, k, v, scale = _inputs()
    fwd = al.AttentionWithLse("auto")
    assert fwd(q, k, v, scale=scale) is None  # CPU tensors: the caller runs SDPA and the kernel's lse pass
    assert list(fwd.plans.values()) == [al.Plan(None)]


def test_backend_label_records_the_lse_source():
    """The index records where each layer's lse came from, so a fallback is visible in the manifest."""
    from sift.kernels.attention_lse import Plan
    from sift.pipeline.profiler import backend_label

    assert backend_label("torch", [Plan("cudnn")]) == "torch"
    assert backend_label("triton", []) == "triton"
    assert backend_label("triton", [Plan("cudnn"), Plan("cudnn", expand_kv=True)]) == "triton+cudnn-lse"
    assert backend_label("triton", [Plan("flash"), Plan(None), Plan("cudnn")]) == \
        "triton+cudnn-lse+flash-lse+triton-lse"


def _varlen_inputs(bounds=(0, 5, 6, 30, 37), **kw):
    from sift.kernels.attention_lse import Sequences

    q, k, v, scale = _inputs(lp=bounds[-1], **kw)
    return q, k, v, scale, Sequences(tuple(bounds), torch.tensor(bounds, dtype=torch.int32))


def _dense_per_sequence(query, key, value, scale, bounds):
    outs, lses = [], []
    for a, b in zip(bounds, bounds[1:]):
        o, lse = _dense(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], scale)
        outs.append(o)
        lses.append(lse[0])
    return torch.cat(outs, dim=2), torch.cat(lses, dim=1)


class _FakeVarlen:
    """Stands in for `attention_lse._run_varlen` (flash's varlen op): modes 'ok' (lse [H, T]), 'padded' (lse
    [B, H, max length], as older flash builds return it), 'across' (one causal sequence: attends across
    documents)."""

    def __init__(self, mode):
        self.mode = mode

    def __call__(self, source, query, key, value, scale, seqs):
        bounds = seqs.bounds
        if self.mode == "across":
            out, lse = _dense(query, key, value, scale)
            return out[0].transpose(0, 1), lse[0]
        out, lse = _dense_per_sequence(query, key, value, scale, bounds)
        if self.mode == "padded":
            padded = torch.full((len(bounds) - 1, query.shape[1], seqs.max_len), float("nan"))
            for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
                padded[i, :, : b - a] = lse[:, a:b]
            lse = padded
        return out[0].transpose(0, 1), lse


@pytest.mark.parametrize("mode", ["ok", "padded"])
def test_varlen_pack_runs_flash_and_returns_lse_per_row(fake, monkeypatch, mode):
    fake(cudnn="ok", flash="ok")
    monkeypatch.setattr(al, "_run_varlen", _FakeVarlen(mode))
    q, k, v, scale, seqs = _varlen_inputs()
    fwd = al.AttentionWithLse("auto")
    out, lse = fwd(q, k, v, scale=scale, seqs=seqs)
    ref_out, ref_lse = _dense_per_sequence(q, k, v, scale, seqs.bounds)
    assert out.shape == (1, 4, 37, 16) and lse.shape == (4, 37)
    torch.testing.assert_close(lse, ref_lse)
    assert torch.equal(out, ref_out)
    assert list(fwd.plans.values()) == [al.Plan("flash", False)]  # cuDNN has no varlen forward here


def test_varlen_result_attending_across_sequences_is_refused(fake, monkeypatch):
    fake(cudnn="ok", flash="ok")
    real = al._run_varlen
    monkeypatch.setattr(al, "_run_varlen", _FakeVarlen("across"))
    q, k, v, scale, seqs = _varlen_inputs()
    with pytest.warns(UserWarning, match="WRONG RESULT, sequence at rows"):
        assert al.AttentionWithLse("auto")(q, k, v, scale=scale, seqs=seqs) is None
    monkeypatch.setattr(al, "_run_varlen", real)  # refuses cuDNN before calling any op
    with pytest.raises(RuntimeError, match="'cudnn' unusable.*no varlen forward"):
        al.AttentionWithLse("cudnn")(q, k, v, scale=scale, seqs=seqs)
