"""Check and time the SIFT profiling kernel (kernels/profile.py) on one GPU; writes JSON to $OUT/profile.json.

Run on the device machine from the repository root:  PYTHONUNBUFFERED=1 python3 bench/bench_profile.py
(the package need not be installed: a shim maps `kernels/` to `sift.kernels`). Without a GPU it runs a tiny
smoke version under TRITON_INTERPRET=1 (nothing timed) and writes bench/results/profile-smoke.json.

1. Correctness against `profile_layer_ref` and a dense softmax oracle: fp32 inputs, and bf16 / fp16 inputs
   against the reference run on the same inputs upcast to fp32. Every differing key count or bit ("flip") must
   be a near-threshold case (|A_ref - threshold| <= 1e-4 * threshold); flips are counted and printed.
2. Time per layer, Llama-3-8B shape (Hq=32, Hkv=8, D=128, bf16, scale 1/sqrt(128), tile 64, 1-token prefix),
   q/k as the model hands them over (views of [L, H, D]), at 2K / 8K / 32K / 128K tokens: profile_layer, its
   two passes, and the same layer's dense causal forward with cuDNN and flash SDPA; peak memory of the call.
   The GPU builder's per-layer cost, old next to new: "old" = flash SDPA with lse + the stats pass as it was
   (pointer-loaded q, OLD_STATS) + the torch finish_bits; "new" = cuDNN SDPA with lse (sift.kernels.
   attention_lse, checked) + the default stats pass + the bits kernel. Both given as x the cuDNN forward.
3. A small sweep of launch parameters at 16K (each also checked against the default's bits).
Exit status 1 if a check found an unexplained flip or failed.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels import triton.jit

import triton  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
from _checkout import use_checkout  # noqa: E402

use_checkout()
from sift.kernels import profile as pk  # noqa: E402
from sift.kernels import attention_lse  # noqa: E402
from sift.kernels.bits import n_pages, tril_to_square, unpack_msb  # noqa: E402
from sift.kernels.profile_ref import profile_layer_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMOKE = DEV == "cpu"
T0 = time.time()
DEADLINE_S = 195.0  # the sweep stops starting new configs after this (whole script must stay under 4 min)
NEAR_RTOL = 1e-4
HQ, HKV, D, TILE = 32, 8, 128, 64
DTYPE = torch.bfloat16
SCALE = D ** -0.5
PAPER = (0.001, 0.01, 0.1)
LENGTHS = [2048, 8192, 32768, 131072] if not SMOKE else [100]
SWEEP_LEN = 16384 if not SMOKE else 100
KC = pk.KernelConfig
# w4 configs use <= 112 KiB of shared memory, so two programs share an SM and one's tensor-core work can
# overlap the other's ALU work; w8 ones run one program per SM (flash-forward style).
LSE_SWEEP = [KC(128, 128, 8, 3), KC(128, 64, 8, 3), KC(128, 128, 8, 2), KC(64, 64, 4, 3)]
# T = q streamed by TMA. w4 ones fit two programs per SM (<= 199 registers, <= 112 KiB shared memory compiled
# for sm_90), so one's MMA can overlap the other's ALU work.
STATS_SWEEP = [
    KC(128, 128, 8, 3), KC(128, 128, 8, 3, tma=True), KC(128, 128, 8, 2, tma=True), KC(64, 128, 4, 3),
    KC(64, 128, 4, 3, tma=True), KC(64, 128, 4, 2, tma=True), KC(128, 64, 4, 3, tma=True),
    KC(64, 128, 4, 3, key_rows=True, tma=True), KC(128, 128, 8, 3, key_rows=True, tma=True),
]
OLD_STATS = KC(128, 128, 8, 3)  # the stats pass's default before TMA (pointer-loaded q)
if SMOKE:  # the interpreter mishandles bf16: fp16, fewer heads
    LSE_SWEEP, STATS_SWEEP = LSE_SWEEP[:1], STATS_SWEEP[:2]
    HQ, HKV, DTYPE = 4, 1, torch.float16


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def cfg_name(c: pk.KernelConfig) -> str:
    return f"m{c.block_m}n{c.block_n}w{c.num_warps}s{c.num_stages}{'K' if c.key_rows else 'Q'}{'T' if c.tma else ''}"


def make_qk(n_ctx, hq, hkv, d, dtype, *, seed=0, strided=True, spread=1.5):
    """q [Hq, Lp, D], k [Hkv, Lp, D]; strided: views of [Lp, H, D] as a transformers forward hands them over.

    N(0, 1) * spread with scale 1/sqrt(D) gives score std ~spread^2, peaked rows like a trained model's.
    """
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = (torch.randn(n_ctx, hq, d, generator=g, device=DEV) * spread).to(dtype)
    k = (torch.randn(n_ctx, hkv, d, generator=g, device=DEV) * spread).to(dtype)
    q, k = q.transpose(0, 1), k.transpose(0, 1)
    return (q, k) if strided else (q.contiguous(), k.contiguous())


# ----------------------------------------------------------------------------------------------- 1. checks
def dense_oracle(q, k, *, n_prefix, tile, scale, softcap):
    """fp32 softmax of the upcast inputs (as profile_layer_ref computes it) -> doc part of A, lse, tile max."""
    qf = q.float()
    kf = k.float().repeat_interleave(q.shape[0] // k.shape[0], dim=0)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    lp = q.shape[1]
    s.masked_fill_(~torch.ones(lp, lp, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)[:, n_prefix:]
    a = torch.softmax(s, dim=-1, dtype=torch.float32)[:, n_prefix:, n_prefix:].contiguous()
    del s
    n = lp - n_prefix
    p = n_pages(n, tile)
    tile_max = torch.nn.functional.pad(a, (0, p * tile - n, 0, p * tile - n)).reshape(
        -1, p, tile, p, tile).amax(dim=(2, 4))
    return a, lse, tile_max


def midpoint(values: torch.Tensor, quantile: float) -> float:
    """A threshold halfway between two adjacent data values (mixed bits, no cell exactly on it)."""
    v = values.flatten()
    if v.numel() > 1 << 24:
        v = v[torch.randperm(v.numel(), device=v.device)[: 1 << 24]]
    v = v.double().sort().values
    if v.numel() == 1:
        return float(v[0]) / 2
    i = min(int(quantile * (v.numel() - 1)), v.numel() - 2)
    return float((v[i] + v[i + 1]) / 2)


def near(x: torch.Tensor, threshold: float) -> torch.Tensor:
    return (x.double() - threshold).abs() <= NEAR_RTOL * threshold


def check_case(name, *, dtype, hq, hkv, d, n_prefix, n_doc, tile, softcap=None, ca_normalize="causal",
               strided=False, configs=None):
    q, k = make_qk(n_prefix + n_doc, hq, hkv, d, dtype, seed=n_doc, strided=strided)
    scale = d ** -0.5
    a, lse_ref, tm_ref = dense_oracle(q, k, n_prefix=n_prefix, tile=tile, scale=scale, softcap=softcap)
    p = n_pages(n_doc, tile)
    causal = torch.ones(n_doc, n_doc, dtype=torch.bool, device=DEV).tril()
    tril = torch.ones(p, p, dtype=torch.bool, device=DEV).tril()
    keys = torch.arange(n_doc, device=DEV)
    denom = (n_doc - keys) if ca_normalize == "causal" else (keys + 1)
    res = dict(name=name, dtype=str(dtype), hq=hq, hkv=hkv, d=d, n_prefix=n_prefix, n_doc=n_doc, tile=tile,
               softcap=softcap, ca_normalize=ca_normalize, strided=strided, thresholds=[])
    beta_mid = midpoint(a[:, causal], 0.9)
    counts_mid = ((a >= torch.tensor(beta_mid, dtype=torch.float32, device=DEV)) & causal).sum(1)
    mids = (midpoint(tm_ref[:, tril], 0.5), beta_mid, min(midpoint(counts_mid.float() / denom, 0.95), 1.0))
    unexplained = 0
    for alpha, beta, gamma in (PAPER, mids):
        stats = pk.profile_stats(q, k, scale=scale, n_prefix=n_prefix, tile=tile, beta=beta, softcap=softcap,
                                 configs=configs)
        counts_ref = ((a >= torch.tensor(beta, dtype=torch.float32, device=DEV)) & causal).sum(1)
        near_cells = (near(a, beta) & causal).sum(1)
        count_diff = (stats.key_counts.long() - counts_ref).abs()
        args = dict(scale=scale, n_prefix=n_prefix, tile=tile, alpha=alpha, beta=beta, gamma=gamma,
                    softcap=softcap, ca_normalize=ca_normalize)
        bits, _ = pk.profile_layer(q, k, configs=configs, **args)
        ref, _ = profile_layer_ref(q.float(), k.float(), **args)
        la_k = tril_to_square(unpack_msb(bits.la, p * (p + 1) // 2), p)
        la_r = tril_to_square(unpack_msb(ref.la, p * (p + 1) // 2), p)
        la_flips = la_k != la_r
        ca_flips = unpack_msb(bits.ca, p) != unpack_msb(ref.ca, p)
        moved = torch.nn.functional.pad(count_diff > 0, (0, p * tile - n_doc)).reshape(hq, p, tile).any(-1)
        bad = int((count_diff > near_cells).sum()) + int((la_flips & ~near(tm_ref, alpha)).sum()) \
            + int((ca_flips & ~moved).sum())
        unexplained += bad
        rel = ((stats.tile_max - tm_ref).abs() / tm_ref.clamp_min(1e-30))[:, tril]
        res["thresholds"].append(dict(
            alpha=alpha, beta=beta, gamma=gamma,
            lse_max_abs_err=(stats.lse - lse_ref).abs().max().item(),
            tile_max_max_rel_err=rel.max().item(),
            count_flips=int(count_diff.sum()), near_beta_cells=int(near_cells.sum()),
            la_flips=int(la_flips.sum()), la_bits=hq * p * (p + 1) // 2, la_density=la_r[:, tril].float().mean().item(),
            ca_flips=int(ca_flips.sum()), ca_bits=hq * p,
            ca_density=unpack_msb(ref.ca, p).float().mean().item(), unexplained=bad))
    res["ok"] = unexplained == 0
    t = res["thresholds"]
    log(f"check {name}: {'ok' if res['ok'] else 'UNEXPLAINED FLIPS'}; lse err {t[0]['lse_max_abs_err']:.2g}, "
        f"tile_max rel err {t[0]['tile_max_max_rel_err']:.2g}; flips (count/LA/CA) paper "
        f"{t[0]['count_flips']}/{t[0]['la_flips']}/{t[0]['ca_flips']}, midpoint "
        f"{t[1]['count_flips']}/{t[1]['la_flips']}/{t[1]['ca_flips']} of {t[1]['la_bits']} LA bits "
        f"(LA density {t[1]['la_density']:.2f}, CA {t[1]['ca_density']:.2f})")
    return res


CHECKS = [
    dict(name="fp32 gqa4 d128 tile64", dtype=torch.float32, hq=8, hkv=2, d=128, n_prefix=1, n_doc=1500, tile=64),
    dict(name="fp32 mha d64 tile16 softcap", dtype=torch.float32, hq=4, hkv=4, d=64, n_prefix=5, n_doc=700,
         tile=16, softcap=30.0),
    dict(name="fp32 gqa3 tile32 key_index", dtype=torch.float32, hq=6, hkv=2, d=128, n_prefix=0, n_doc=999,
         tile=32, ca_normalize="key_index"),
    dict(name="bf16 llama tile64 strided", dtype=torch.bfloat16, hq=HQ, hkv=HKV, d=D, n_prefix=1, n_doc=2500,
         tile=64, strided=True),
    dict(name="bf16 llama tile128", dtype=torch.bfloat16, hq=HQ, hkv=HKV, d=D, n_prefix=3, n_doc=2000, tile=128),
    dict(name="bf16 gqa4 tile16", dtype=torch.bfloat16, hq=8, hkv=2, d=D, n_prefix=1, n_doc=1200, tile=16),
    dict(name="fp16 gqa4 tile32 softcap", dtype=torch.float16, hq=8, hkv=2, d=D, n_prefix=1, n_doc=1100,
         tile=32, softcap=50.0, strided=True),
    dict(name="bf16 one-token doc", dtype=torch.bfloat16, hq=HQ, hkv=HKV, d=D, n_prefix=1, n_doc=1, tile=64),
]
if SMOKE:
    CHECKS = [dict(c, n_doc=min(c["n_doc"], 70), hq=min(c["hq"], 4), hkv=min(c["hkv"], 2),
                   dtype=torch.float16 if c["dtype"] == torch.bfloat16 else c["dtype"]) for c in CHECKS]


# ----------------------------------------------------------------------------------------------- 2. timing
def bench_ms(fn, n_ctx):
    """Median ms; fewer repetitions at long lengths (128K SDPA is ~0.24 s a call)."""
    if SMOKE:
        fn()
        return float("nan")
    rep = 100 if n_ctx <= 8192 else 300 if n_ctx <= 32768 else 800
    return triton.testing.do_bench(fn, warmup=min(rep, 50), rep=rep, return_mode="median")


def sdpa_fn(backend, q, k, v):
    """Dense causal forward of the layer with one SDPA backend; GQA natively, else with expanded K/V."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    q4, k4, v4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)

    def native():
        with sdpa_kernel(be):
            return sdpa(q4, k4, v4, is_causal=True, scale=SCALE, enable_gqa=True)

    try:
        native()
        return native, "native"
    except RuntimeError:
        g = q.shape[0] // k.shape[0]
        ke, ve = k4.repeat_interleave(g, dim=1), v4.repeat_interleave(g, dim=1)

        def expanded():
            with sdpa_kernel(be):
                return sdpa(q4, ke, ve, is_causal=True, scale=SCALE)

        expanded()
        return expanded, "expanded"


def forward_with_lse(source, q, k, v):
    """The dense forward that also returns the row log-sum-exp [Hq, Lp] (natural log), as the GPU builder runs
    it (`sift.kernels.attention_lse`, this source only, checked on its first call); `profile_layer(lse=...)`
    then skips its first pass. Returns (fn, "native" or "expanded" GQA)."""
    fwd = attention_lse.AttentionWithLse(source)
    q4, k4, v4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)

    def fn():
        return fwd(q4, k4, v4, scale=SCALE)[1]

    fn()
    plan = next(iter(fwd.plans.values()))
    return fn, "expanded" if plan.expand_kv else "native"


def time_length(n_doc):
    n_prefix = 1
    lp = n_prefix + n_doc
    q, k = make_qk(lp, HQ, HKV, D, DTYPE, seed=1)
    v = make_qk(lp, HKV, HKV, D, DTYPE, seed=2)[1]
    args = dict(scale=SCALE, n_prefix=n_prefix, tile=TILE, alpha=PAPER[0], beta=PAPER[1], gamma=PAPER[2])
    lse_cfg, stats_cfg = pk.default_configs(TILE, D, q.dtype)
    row = dict(n_doc=n_doc, n_ctx=lp, configs=[cfg_name(lse_cfg), cfg_name(stats_cfg)])
    causal_flops = 4.0 * HQ * D * lp * (lp + 1) / 2  # QK^T + PV (= the kernel's two QK^T passes)

    def profile():
        return pk.profile_layer(q, k, **args)

    profile()
    torch.cuda.synchronize() if not SMOKE else None
    if not SMOKE:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        profile()
        torch.cuda.synchronize()
        row["profile_peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        row["qk_inputs_mib"] = (q.numel() + k.numel()) * 2 / 2**20
    row["profile_ms"] = bench_ms(profile, n_doc)
    lse2 = pk._launch_lse(q, k, n_prefix=n_prefix, scale=SCALE, softcap=None, cfg=lse_cfg)
    row["lse_pass_ms"] = bench_ms(
        lambda: pk._launch_lse(q, k, n_prefix=n_prefix, scale=SCALE, softcap=None, cfg=lse_cfg), n_doc)
    lse = torch.zeros(HQ, lp, device=DEV)
    lse[:, n_prefix:] = lse2 / pk.LOG2E
    row["stats_and_bits_ms"] = bench_ms(lambda: pk.profile_layer(q, k, lse=lse, **args), n_doc)
    old = dict(configs=(lse_cfg, OLD_STATS), bits="torch")
    row["old_stats_and_bits_ms"] = bench_ms(lambda: pk.profile_layer(q, k, lse=lse, **old, **args), n_doc)
    mine, _ = profile()
    theirs, _ = pk.profile_layer(q, k, lse=lse, **old, **args)
    row["bit_flips_old_vs_new_stats"] = int((mine.la != theirs.la).sum() + (mine.ca != theirs.ca).sum())
    for source in ("flash", "cudnn"):
        if SMOKE:
            continue
        try:
            fn, gqa = forward_with_lse(source, q, k, v)
            fwd_lse = fn()
            row[f"{source}_lse_max_abs_err"] = (fwd_lse[:, n_prefix:] - lse[:, n_prefix:]).abs().max().item()
            theirs, _ = pk.profile_layer(q, k, lse=fwd_lse, **args)
            row[f"bit_flips_with_{source}_lse"] = int((mine.la != theirs.la).sum() + (mine.ca != theirs.ca).sum())
            row[f"{source}_with_lse_ms"] = bench_ms(fn, n_doc)
            row[f"{source}_with_lse_gqa"] = gqa
        except Exception as e:  # noqa: BLE001
            row[f"{source}_with_lse_error"] = f"{type(e).__name__}: {e}"[:300]
    for backend in ("cudnn", "flash"):
        if SMOKE:
            continue
        try:
            fn, gqa = sdpa_fn(backend, q, k, v)
            row[f"{backend}_ms"] = bench_ms(fn, n_doc)
            row[f"{backend}_gqa"] = gqa
            row[f"{backend}_tflops"] = causal_flops / row[f"{backend}_ms"] / 1e9
        except Exception as e:  # noqa: BLE001 - a missing backend is reported, not fatal
            row[f"{backend}_error"] = f"{type(e).__name__}: {e}"[:300]
    row["profile_tflops"] = causal_flops / row["profile_ms"] / 1e9
    # The builder's attention + bits per layer: old (flash + old stats + torch bits) vs new (cuDNN + defaults).
    if "flash_with_lse_ms" in row:
        row["layer_old_ms"] = row["flash_with_lse_ms"] + row["old_stats_and_bits_ms"]
    if "cudnn_with_lse_ms" in row:
        row["layer_new_ms"] = row["cudnn_with_lse_ms"] + row["stats_and_bits_ms"]
    for key in ("layer_old_ms", "layer_new_ms"):
        if key in row and "cudnn_ms" in row:
            row[key.replace("_ms", "_over_cudnn")] = row[key] / row["cudnn_ms"]
    for backend in ("cudnn", "flash"):
        if f"{backend}_ms" in row:
            row[f"profile_over_{backend}"] = row["profile_ms"] / row[f"{backend}_ms"]
            # With the forward's lse the builder only adds the stats pass (+ bits) to the attention it runs anyway.
            row[f"stats_over_{backend}"] = row["stats_and_bits_ms"] / row[f"{backend}_ms"]
    log(f"timing L={n_doc}: " + ", ".join(f"{key}={val:.3g}" if isinstance(val, float) else f"{key}={val}"
                                          for key, val in row.items() if key not in ("n_doc",)))
    del q, k, v, lse, lse2
    if not SMOKE:
        torch.cuda.empty_cache()
    return row


# ----------------------------------------------------------------------------------------------- 3. sweep
def sweep():
    n_prefix = 1
    lp = n_prefix + SWEEP_LEN
    q, k = make_qk(lp, HQ, HKV, D, DTYPE, seed=3)
    args = dict(scale=SCALE, n_prefix=n_prefix, tile=TILE, alpha=PAPER[0], beta=PAPER[1], gamma=PAPER[2])
    default_lse, default_stats = pk.default_configs(TILE, D, q.dtype)
    ref_bits, _ = pk.profile_layer(q, k, **args)
    p = n_pages(SWEEP_LEN, TILE)
    out = dict(n_doc=SWEEP_LEN, lse=[], stats=[])
    for cfg in LSE_SWEEP:
        if time.time() - T0 > DEADLINE_S:
            out["stopped_at_deadline"] = True
            break
        try:
            pk._launch_lse(q, k, n_prefix=n_prefix, scale=SCALE, softcap=None, cfg=cfg)
            ms = bench_ms(lambda: pk._launch_lse(q, k, n_prefix=n_prefix, scale=SCALE, softcap=None, cfg=cfg),
                          SWEEP_LEN)
            out["lse"].append(dict(config=cfg_name(cfg), ms=ms))
        except Exception as e:  # noqa: BLE001
            out["lse"].append(dict(config=cfg_name(cfg), error=f"{type(e).__name__}: {e}"[:300]))
        log(f"sweep lse {out['lse'][-1]}")
    lse2 = pk._launch_lse(q, k, n_prefix=n_prefix, scale=SCALE, softcap=None, cfg=default_lse)
    lse = torch.zeros(q.shape[0], lp, device=DEV)
    lse[:, n_prefix:] = lse2 / pk.LOG2E
    for cfg in STATS_SWEEP:
        if time.time() - T0 > DEADLINE_S:
            out["stopped_at_deadline"] = True
            break
        try:
            bits, _ = pk.profile_layer(q, k, lse=lse, configs=(default_lse, cfg), **args)
            flips = int((unpack_msb(bits.la, p * (p + 1) // 2) != unpack_msb(ref_bits.la, p * (p + 1) // 2)).sum()
                        + (unpack_msb(bits.ca, p) != unpack_msb(ref_bits.ca, p)).sum())
            ms = bench_ms(lambda: pk.profile_layer(q, k, lse=lse, configs=(default_lse, cfg), **args), SWEEP_LEN)
            out["stats"].append(dict(config=cfg_name(cfg), ms=ms, bit_flips_vs_default=flips))
        except Exception as e:  # noqa: BLE001
            out["stats"].append(dict(config=cfg_name(cfg), error=f"{type(e).__name__}: {e}"[:300]))
        log(f"sweep stats+bits {out['stats'][-1]}")
    out["default"] = [cfg_name(default_lse), cfg_name(default_stats)]
    return out


# ----------------------------------------------------------------------------------------------- main
def main() -> int:
    if not SMOKE:
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be IEEE fp32
        torch.backends.cudnn.allow_tf32 = False
    result = dict(
        script="bench/bench_profile.py", when=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        device=torch.cuda.get_device_name() if not SMOKE else "cpu (TRITON_INTERPRET=1 smoke run)",
        torch=torch.__version__, triton=triton.__version__, smoke=SMOKE,
        shape=dict(hq=HQ, hkv=HKV, d=D, tile=TILE, dtype=str(DTYPE), n_prefix=1, scale=SCALE),
        checks=[], timing=[], sweep=None, errors=[],
    )
    failed = False
    for spec in CHECKS:
        try:
            res = check_case(**spec)
            failed |= not res["ok"]
            result["checks"].append(res)
        except Exception as e:  # noqa: BLE001 - keep going, report at the end
            failed = True
            result["errors"].append(f"check {spec['name']}: {type(e).__name__}: {e}")
            log(f"check {spec['name']} FAILED:\n{traceback.format_exc()}")
        if not SMOKE:
            torch.cuda.empty_cache()
    for n in LENGTHS:
        try:
            result["timing"].append(time_length(n))
        except Exception as e:  # noqa: BLE001
            failed = True
            result["errors"].append(f"timing L={n}: {type(e).__name__}: {e}")
            log(f"timing L={n} FAILED:\n{traceback.format_exc()}")
    try:
        result["sweep"] = sweep()
    except Exception as e:  # noqa: BLE001
        result["errors"].append(f"sweep: {type(e).__name__}: {e}")
        log(f"sweep FAILED:\n{traceback.format_exc()}")
    result["elapsed_s"] = time.time() - T0
    result["ok"] = not failed

    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / ("profile.json" if os.environ.get("OUT") else "profile-smoke.json" if SMOKE
                      else "profile-local.json")
    path.write_text(json.dumps(result, indent=1, default=str))

    print(f"\nwrote {path}")
    print("checks: " + ", ".join(f"{c['name']}={'ok' if c['ok'] else 'FAIL'}" for c in result["checks"]))
    if result["sweep"]:
        best = lambda rows: min((r for r in rows if "ms" in r), key=lambda r: r["ms"], default=None)  # noqa: E731
        print(f"sweep @{result['sweep']['n_doc']}: default {result['sweep']['default']}; best lse "
              f"{best(result['sweep']['lse'])}; best stats+bits {best(result['sweep']['stats'])}")
    print("profile = both passes + bits; stats = second pass + bits given the forward's lse; x = time / SDPA time")
    print("old stats = previous stats config + torch finish_bits; layer old = flash+lse + old stats; "
          "layer new = cuDNN+lse + stats (the builder's attention + bits per layer)")
    print(f"{'L':>7} {'profile ms':>10} {'lse ms':>8} {'stats ms':>9} {'old stats':>9} {'cudnn ms':>9} "
          f"{'flash ms':>9} {'cudnn+lse':>9} {'flash+lse':>9} {'x cudnn':>8} {'stats x':>8} {'old x':>7} "
          f"{'new x':>7} {'peak MiB':>9}")
    for r in result["timing"]:
        f = lambda key, w, fmt=".2f": f"{r[key]:{w}{fmt}}" if isinstance(r.get(key), float) else f"{'-':>{w}}"  # noqa: E731
        print(f"{r['n_doc']:>7} {f('profile_ms', 10)} {f('lse_pass_ms', 8)} {f('stats_and_bits_ms', 9)} "
              f"{f('old_stats_and_bits_ms', 9)} {f('cudnn_ms', 9)} {f('flash_ms', 9)} {f('cudnn_with_lse_ms', 9)} "
              f"{f('flash_with_lse_ms', 9)} {f('profile_over_cudnn', 8)} {f('stats_over_cudnn', 8)} "
              f"{f('layer_old_over_cudnn', 7)} {f('layer_new_over_cudnn', 7)} {f('profile_peak_mib', 9, '.0f')}")
    print(f"ok={result['ok']} elapsed {result['elapsed_s']:.0f}s; errors: {result['errors'] or 'none'}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
