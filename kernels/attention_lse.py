"""A layer's dense causal attention forward that also returns the row log-sum-exp, for the GPU profiler.

The GPU builder runs each layer's attention anyway (its output continues the forward pass); when that forward
also hands back the row log-sum-exp, the profiling kernel (`profile.profile_layer(lse=...)`) skips its own
first pass. Two torch SDPA backends return it:

* "cudnn": `aten._scaled_dot_product_cudnn_attention(..., compute_log_sumexp=True)`, the faster dense
  forward on Hopper at long contexts (`bench/bench_profile.py` times both); lse [B, H, L] or [B, H, L, 1];
* "flash": `aten._scaled_dot_product_flash_attention`; lse [B, H, L].

A pack of several sequences (documents packed back to back, each attending to itself only: `Sequences`) runs
flash's varlen forward, `aten._flash_attention_forward` with the sequence offsets (the op nested tensors run);
its lse comes as [H, T] or, in older builds, [B, H, max length], and is returned as [H, T] either way.

Both are private ops whose shapes and conventions are not part of torch's public API, so nothing is taken on
trust: the first call of each shape class (dtype, heads, head dims, scale, power-of-two length bucket) checks
the output and the natural-log lse of a few rows (first, middle, last; every head; of the first, middle and last
sequence of a pack) against an fp32 recomputation from q/k/v, and a backend that fails the check or raises is
passed over with a warning for the next one.
GQA: both take Hkv < Hq key heads natively; a backend that refuses them is retried with K/V expanded to Hq
heads (one copy of K and V, small next to the attention itself).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .packing import PackedDocs

LSE_SOURCES = ("cudnn", "flash")
LSE_CHOICES = ("auto",) + LSE_SOURCES  # "auto": cuDNN, else flash
_CHECK_KEYS = 8192  # key chunk of the check's fp32 recomputation


@dataclass(frozen=True)
class Plan:
    """What one shape class runs: `source` (None: no backend usable, the caller computes the lse itself) and
    whether K/V are expanded to the query heads."""

    source: str | None
    expand_kv: bool = False


@dataclass(frozen=True, eq=False)
class Sequences:
    """Sequences packed along the rows of one forward: boundaries on the host (checks) and on the device (the
    varlen op)."""

    bounds: tuple[int, ...]  # [0, end_0, end_1, ..., T]
    device_bounds: torch.Tensor  # the same, int32 [B + 1] on the query's device

    @classmethod
    def of(cls, docs: PackedDocs, device_bounds: torch.Tensor) -> "Sequences":
        return cls(docs.cu_seqlens, device_bounds)

    @property
    def max_len(self) -> int:
        return max(b - a for a, b in zip(self.bounds, self.bounds[1:]))

    def checked(self) -> list[tuple[int, int]]:
        """(start, end) of the sequences the first call of a shape class checks: first, middle, last."""
        n = len(self.bounds) - 1
        return [(self.bounds[i], self.bounds[i + 1]) for i in sorted({0, n // 2, n - 1})]


def _may_run(query) -> bool:
    """Both backends take fp16 / bf16 CUDA tensors only."""
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)


def _run(source: str, query, key, value, scale: float):
    if source == "cudnn":
        r = torch.ops.aten._scaled_dot_product_cudnn_attention(query, key, value, None, True, 0.0, True, False,
                                                              scale=scale)
    elif source == "flash":
        r = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, True, False, scale=scale)
    else:
        raise ValueError(f"lse source {source!r} must be one of {LSE_SOURCES}")
    return r[0], r[1]


def _run_varlen(source: str, query, key, value, scale: float, seqs: Sequences):
    """query [1, Hq, T, D], key / value [1, Hkv, T, D] (views of [T, H, D]) -> the op's (out, lse)."""
    if source != "flash":
        raise RuntimeError(f"{source}: no varlen forward (packs of several sequences run flash)")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    cu, n = seqs.device_bounds, seqs.max_len
    r = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, n, n, 0.0, True, False, scale=scale)
    return r[0], r[1]


def _shaped_varlen(source: str, out, lse, query, value, seqs: Sequences) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen results -> (out [1, Hq, T, Dv] (a view of [T, Hq, Dv]), lse [Hq, T] fp32)."""
    _, hq, t, _ = query.shape
    want_out = (t, hq, value.shape[-1])
    if tuple(out.shape) != want_out:
        raise RuntimeError(f"{source} varlen: output shape {tuple(out.shape)}, expected {want_out}")
    if lse.dtype != torch.float32:
        raise RuntimeError(f"{source} varlen: logsumexp {lse.dtype}, expected float32")
    b = len(seqs.bounds) - 1
    if tuple(lse.shape) == (b, hq, seqs.max_len):  # padded per sequence: gather each row's own
        lengths = seqs.device_bounds[1:] - seqs.device_bounds[:-1]
        seq = torch.repeat_interleave(torch.arange(b, device=lse.device), lengths, output_size=t)
        row = torch.arange(t, device=lse.device) - seqs.device_bounds[:-1].long()[seq]
        lse = lse[seq, :, row].transpose(0, 1)
    elif tuple(lse.shape) != (hq, t):
        raise RuntimeError(f"{source} varlen: logsumexp {tuple(lse.shape)}, expected [{hq}, {t}] or "
                           f"[{b}, {hq}, {seqs.max_len}]")
    return out.transpose(0, 1).unsqueeze(0), lse


def _shaped(source: str, out, lse, query, value) -> tuple[torch.Tensor, torch.Tensor]:
    """Backend results -> (out [1, Hq, Lp, Dv], lse [Hq, Lp] fp32); RuntimeError on an unexpected shape."""
    _, hq, lp, _ = query.shape
    want_out = (1, hq, lp, value.shape[-1])
    if tuple(out.shape) != want_out:
        raise RuntimeError(f"{source}: output shape {tuple(out.shape)}, expected {want_out}")
    if lse.dim() == 4 and lse.shape[-1] == 1:
        lse = lse[..., 0]
    if tuple(lse.shape) != (1, hq, lp) or lse.dtype != torch.float32:
        raise RuntimeError(f"{source}: logsumexp {lse.dtype} {tuple(lse.shape)}, expected float32 [1, {hq}, {lp}] "
                           "(optionally with a trailing 1)")
    return out, lse[0]


def check_rows(query, key, value, out, lse, scale: float, seqs: list[tuple[int, int]] | None = None) -> str | None:
    """Compare out / lse of the first, middle and last rows (every head) of each checked sequence with an fp32
    recomputation over that sequence's keys.

    query [1, Hq, T, D], key / value [1, Hkv, T, D(v)], out [1, Hq, T, Dv], lse [Hq, T] natural log; seqs: the
    (start, end) rows of the sequences to check (None: the rows are one sequence). Returns None when they
    agree, else a message naming the error. Tolerances: lse to 1e-3 (relative above 1; the backends' own are
    ~1e-5 at 32K), output to 2% of the rows' largest value (bf16 output rounding is 0.4%); a wrong log base,
    head order, layout or a sequence attending to another misses both by far.
    """
    for a, b in seqs or [(0, query.shape[2])]:
        bad = _check_sequence(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], out[:, :, a:b], lse[:, a:b],
                              scale)
        if bad is not None:
            return bad if seqs is None else f"sequence at rows [{a}, {b}): {bad}"
    return None


def _check_sequence(query, key, value, out, lse, scale: float) -> str | None:
    _, hq, lp, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    rows = sorted({0, lp // 2, lp - 1})
    r = len(rows)
    idx = torch.tensor(rows, device=query.device)
    qg = query[0].index_select(1, idx).float().reshape(hkv, g * r, d)  # query head h = kv head h // g
    s = torch.empty(hkv, g * r, lp, dtype=torch.float32, device=query.device)
    for c0 in range(0, lp, _CHECK_KEYS):
        s[..., c0:c0 + _CHECK_KEYS] = qg @ key[0, :, c0:c0 + _CHECK_KEYS].float().transpose(-1, -2)
    s = (s * scale).view(hq, r, lp)
    s.masked_fill_(torch.arange(lp, device=query.device)[None, None, :] > idx[None, :, None], float("-inf"))
    lse_ref = torch.logsumexp(s, dim=-1)  # [Hq, r]
    p = torch.softmax(s, dim=-1).view(hkv, g * r, lp)
    o_ref = torch.zeros(hkv, g * r, value.shape[-1], dtype=torch.float32, device=query.device)
    for c0 in range(0, lp, _CHECK_KEYS):
        o_ref += p[..., c0:c0 + _CHECK_KEYS] @ value[0, :, c0:c0 + _CHECK_KEYS].float()
    o_ref = o_ref.view(hq, r, -1)
    lse_err = (lse.index_select(1, idx).float() - lse_ref).abs().max().item()
    lse_tol = 1e-3 * max(1.0, lse_ref.abs().max().item())
    out_err = (out[0].index_select(1, idx).float() - o_ref).abs().max().item()
    out_tol = 2e-2 * o_ref.abs().max().item() + 1e-6
    if not (lse_err <= lse_tol and out_err <= out_tol):  # also catches NaN
        return (f"rows {rows}: lse max abs err {lse_err:.3g} (tolerance {lse_tol:.3g}), output max abs err "
                f"{out_err:.3g} (tolerance {out_tol:.3g})")
    return None


class AttentionWithLse:
    """Dense causal attention with its row log-sum-exp, from the first backend that runs and checks out.

    source: "auto" (cuDNN, else flash), "cudnn" or "flash" (only that one; RuntimeError if it fails).
    Call with query [1, Hq, T, D], key / value [1, Hkv, T, D(v)] (any strides, CUDA, fp16 / bf16) and, for a
    pack of several sequences each attending to itself only, `seqs` -> (out [1, Hq, T, Dv], lse [Hq, T] fp32
    natural log) or None where no backend is usable (fp32, a head dim the kernels do not take, ...): the
    caller then computes both itself (`profile.attention_packed`). Packs run flash's varlen forward (cuDNN's
    is not used), so "cudnn" refuses them. `plans` records what each shape class runs; passed-over backends
    are warned about.
    """

    def __init__(self, source: str = "auto"):
        if source not in LSE_CHOICES:
            raise ValueError(f"lse source {source!r} must be one of {LSE_CHOICES}")
        self.source = source
        self.plans: dict[tuple, Plan] = {}

    def __call__(self, query, key, value, *, scale: float, seqs: Sequences | None = None):
        if query.dim() != 4 or query.shape[0] != 1 or key.shape[:3] != value.shape[:3] or key.shape[0] != 1:
            raise ValueError(f"query [1, Hq, Lp, D] and key / value [1, Hkv, Lp, D] expected; got "
                             f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
        hq, hkv = query.shape[1], key.shape[1]
        if hq % hkv or key.shape[2] != query.shape[2]:
            raise ValueError(f"query {tuple(query.shape)} and key {tuple(key.shape)}: heads must divide, lengths "
                             "match")
        length = "varlen" if seqs is not None else query.shape[2].bit_length()
        shape_class = (query.dtype, query.device, hq, hkv, query.shape[-1], value.shape[-1], float(scale), length)
        plan = self.plans.get(shape_class)
        if plan is None:
            plan, result = self._choose(query, key, value, scale, seqs)
            self.plans[shape_class] = plan
            return result
        if plan.source is None:
            return None
        return self._call(plan, query, key, value, scale, seqs)

    @staticmethod
    def _call(plan: Plan, query, key, value, scale, seqs: Sequences | None):
        if plan.expand_kv:
            g = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(g, dim=1), value.repeat_interleave(g, dim=1)
        if seqs is not None:
            out, lse = _run_varlen(plan.source, query, key, value, scale, seqs)
            return _shaped_varlen(plan.source, out, lse, query, value, seqs)
        out, lse = _run(plan.source, query, key, value, scale)
        return _shaped(plan.source, out, lse, query, value)

    def _choose(self, query, key, value, scale, seqs: Sequences | None):
        if not _may_run(query):
            return Plan(None), None
        sources = LSE_SOURCES if self.source == "auto" else (self.source,)
        if seqs is not None:
            sources = tuple(source for source in sources if source == "flash") or sources
        expands = (False, True) if key.shape[1] != query.shape[1] else (False,)
        failures = []
        for source in sources:
            for expand in expands:
                plan = Plan(source, expand)
                try:
                    out, lse = self._call(plan, query, key, value, scale, seqs)
                except (RuntimeError, TypeError, ValueError) as e:  # shapes it does not take, not built in, op changed
                    first = (str(e).splitlines() or [type(e).__name__])[0][:200]
                    failures.append(f"{source}{' (K/V expanded)' if expand else ''}: {first}")
                    continue
                bad = check_rows(query, key, value, out, lse, scale, seqs.checked() if seqs is not None else None)
                if bad is None:
                    if failures:
                        warnings.warn(f"attention lse from {source}{' with expanded K/V' if expand else ''}; "
                                      f"passed over: {'; '.join(failures)}", stacklevel=3)
                    return plan, (out, lse)
                failures.append(f"{source}{' (K/V expanded)' if expand else ''}: WRONG RESULT, {bad}")
                break  # a wrong result is not a shape problem: do not retry this backend expanded
        if self.source != "auto":
            raise RuntimeError(f"attention lse source {self.source!r} unusable for q {tuple(query.shape)} "
                               f"{query.dtype}: {'; '.join(failures)}")
        warnings.warn(f"no SDPA backend returns a checked lse for q {tuple(query.shape)} {query.dtype} "
                      f"({'; '.join(failures)}); the profiling kernel computes it (slower)", stacklevel=3)
        return Plan(None), None
