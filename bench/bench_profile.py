"""Check and time the SIFT profiling kernel (`sift.kernels.profile`) on one GPU -> bench/results/profile.json.

    python bench/bench_profile.py [--lengths 2048,8192,32768,131072] [--sweep-len 16384] [--out DIR]
    python bench/bench_profile.py --smoke      # tiny shapes on CPU (TRITON_INTERPRET=1), nothing timed

1. Correctness against `profile_layer_ref` and a dense softmax oracle: fp32 inputs, and bf16 / fp16 inputs
   against the reference run on the same inputs upcast to fp32. Every differing key count or bit ("flip") must
   be a near-threshold case (|A_ref - threshold| <= 1e-4 * threshold); flips are counted and printed.
2. Time per layer, Llama-3-8B shape (Hq=32, Hkv=8, D=128, bf16, scale 1/sqrt(128), tile 64, 1-token prefix),
   q/k as the model hands them over (views of [L, H, D]): profile_layer, its two passes, and the same layer's
   dense causal forward with cuDNN and flash SDPA (the baseline, same run); peak memory of the call. The GPU
   builder's per-layer cost: cuDNN SDPA with its lse (`sift.kernels.attention_lse`, checked) + the stats pass
   + the bits kernel, also given as a multiple of the plain cuDNN forward.
3. A small sweep of launch parameters (each also checked against the default's bits).
Exit status 1 if a check found an unexplained flip or failed.
"""
from __future__ import annotations

import time
import traceback
from dataclasses import dataclass

from common import parser, smoke_env

SMOKE = smoke_env()  # before the kernels import triton

import torch  # noqa: E402
from common import RESULTS, gpu_ms, write_result  # noqa: E402

from sift.format import n_pages  # noqa: E402
from sift.kernels import attention_lse  # noqa: E402
from sift.kernels import profile as pk  # noqa: E402
from sift.kernels.bits import tril_to_square, unpack_msb  # noqa: E402
from sift.kernels.numerics import LOG2E  # noqa: E402
from sift.kernels.profile_ref import profile_layer_ref  # noqa: E402

T0 = time.time()
NEAR_RTOL = 1e-4
D, TILE = 128, 64
SCALE = D ** -0.5
PAPER = (0.001, 0.01, 0.1)
KC = pk.ProfileKernelConfig
LSE_SWEEP = [KC(128, 128, 8, 3), KC(128, 64, 8, 3), KC(128, 128, 8, 2), KC(64, 64, 4, 3)]
# T = q streamed by TMA. w4 configs fit two programs per SM (<= 199 registers, <= 112 KiB shared memory compiled
# for sm_90), so one's MMA can overlap the other's ALU work; w8 ones run one program per SM (flash-forward style).
STATS_SWEEP = [
    KC(128, 128, 8, 3), KC(128, 128, 8, 3, tma=True), KC(128, 128, 8, 2, tma=True), KC(64, 128, 4, 3),
    KC(64, 128, 4, 3, tma=True), KC(64, 128, 4, 2, tma=True), KC(128, 64, 4, 3, tma=True),
    KC(64, 128, 4, 3, key_rows=True, tma=True), KC(128, 128, 8, 3, key_rows=True, tma=True),
]


@dataclass(frozen=True)
class Setup:
    """Where and at which model shape the script runs; --smoke: CPU interpreter, fp16 (the interpreter
    mishandles bf16), fewer heads."""

    dev: str
    hq: int
    hkv: int
    dtype: torch.dtype
    smoke: bool


GPU = Setup(dev="cuda", hq=32, hkv=8, dtype=torch.bfloat16, smoke=False)
CPU_SMOKE = Setup(dev="cpu", hq=4, hkv=1, dtype=torch.float16, smoke=True)


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def cfg_name(c: pk.ProfileKernelConfig) -> str:
    return f"m{c.block_m}n{c.block_n}w{c.num_warps}s{c.num_stages}{'K' if c.key_rows else 'Q'}{'T' if c.tma else ''}"


def make_qk(s: Setup, n_ctx, hq, hkv, d, dtype, *, seed=0, strided=True, spread=1.5):
    """q [Hq, Lp, D], k [Hkv, Lp, D]; strided: views of [Lp, H, D] as a transformers forward hands them over.

    N(0, 1) * spread with scale 1/sqrt(D) gives score std ~spread^2, peaked rows like a trained model's.
    """
    g = torch.Generator(device=s.dev).manual_seed(seed)
    q = (torch.randn(n_ctx, hq, d, generator=g, device=s.dev) * spread).to(dtype)
    k = (torch.randn(n_ctx, hkv, d, generator=g, device=s.dev) * spread).to(dtype)
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


def check_thresholds(q, k, a, lse_ref, tm_ref, *, alpha, beta, gamma, n_prefix, tile, softcap, ca_normalize):
    """One (alpha, beta, gamma) of a check case: errors of the statistics and flips of the bits."""
    hq, n_doc, dev = q.shape[0], a.shape[-1], q.device
    scale = q.shape[-1] ** -0.5
    p = n_pages(n_doc, tile)
    causal = torch.ones(n_doc, n_doc, dtype=torch.bool, device=dev).tril()
    tril = torch.ones(p, p, dtype=torch.bool, device=dev).tril()
    stats = pk.profile_stats(q, k, scale=scale, n_prefix=n_prefix, tile=tile, beta=beta, softcap=softcap)
    counts_ref = ((a >= torch.tensor(beta, dtype=torch.float32, device=dev)) & causal).sum(1)
    near_cells = (near(a, beta) & causal).sum(1)
    count_diff = (stats.key_counts.long() - counts_ref).abs()
    args = dict(scale=scale, n_prefix=n_prefix, tile=tile, alpha=alpha, beta=beta, gamma=gamma,
                softcap=softcap, ca_normalize=ca_normalize)
    bits, _ = pk.profile_layer(q, k, **args)
    ref, _ = profile_layer_ref(q.float(), k.float(), **args)
    la_k = tril_to_square(unpack_msb(bits.la, p * (p + 1) // 2), p)
    la_r = tril_to_square(unpack_msb(ref.la, p * (p + 1) // 2), p)
    la_flips = la_k != la_r
    ca_flips = unpack_msb(bits.ca, p) != unpack_msb(ref.ca, p)
    moved = torch.nn.functional.pad(count_diff > 0, (0, p * tile - n_doc)).reshape(hq, p, tile).any(-1)
    bad = int((count_diff > near_cells).sum()) + int((la_flips & ~near(tm_ref, alpha)).sum()) \
        + int((ca_flips & ~moved).sum())
    rel = ((stats.tile_max - tm_ref).abs() / tm_ref.clamp_min(1e-30))[:, tril]
    return dict(
        alpha=alpha, beta=beta, gamma=gamma,
        lse_max_abs_err=(stats.lse - lse_ref).abs().max().item(),
        tile_max_max_rel_err=rel.max().item(),
        count_flips=int(count_diff.sum()), near_beta_cells=int(near_cells.sum()),
        la_flips=int(la_flips.sum()), la_bits=hq * p * (p + 1) // 2, la_density=la_r[:, tril].float().mean().item(),
        ca_flips=int(ca_flips.sum()), ca_bits=hq * p,
        ca_density=unpack_msb(ref.ca, p).float().mean().item(), unexplained=bad)


def check_case(s: Setup, name, *, dtype, hq, hkv, d, n_prefix, n_doc, tile, softcap=None, ca_normalize="causal",
               strided=False):
    """The paper's thresholds and data-midpoint ones (mixed bits) on one shape."""
    q, k = make_qk(s, n_prefix + n_doc, hq, hkv, d, dtype, seed=n_doc, strided=strided)
    a, lse_ref, tm_ref = dense_oracle(q, k, n_prefix=n_prefix, tile=tile, scale=d ** -0.5, softcap=softcap)
    p = n_pages(n_doc, tile)
    causal = torch.ones(n_doc, n_doc, dtype=torch.bool, device=s.dev).tril()
    tril = torch.ones(p, p, dtype=torch.bool, device=s.dev).tril()
    keys = torch.arange(n_doc, device=s.dev)
    denom = (n_doc - keys) if ca_normalize == "causal" else (keys + 1)
    beta_mid = midpoint(a[:, causal], 0.9)
    counts_mid = ((a >= torch.tensor(beta_mid, dtype=torch.float32, device=s.dev)) & causal).sum(1)
    mids = (midpoint(tm_ref[:, tril], 0.5), beta_mid, min(midpoint(counts_mid.float() / denom, 0.95), 1.0))
    t = [check_thresholds(q, k, a, lse_ref, tm_ref, alpha=alpha, beta=beta, gamma=gamma, n_prefix=n_prefix,
                          tile=tile, softcap=softcap, ca_normalize=ca_normalize)
         for alpha, beta, gamma in (PAPER, mids)]
    res = dict(name=name, dtype=str(dtype), hq=hq, hkv=hkv, d=d, n_prefix=n_prefix, n_doc=n_doc, tile=tile,
               softcap=softcap, ca_normalize=ca_normalize, strided=strided, thresholds=t,
               ok=sum(x["unexplained"] for x in t) == 0)
    log(f"check {name}: {'ok' if res['ok'] else 'UNEXPLAINED FLIPS'}; lse err {t[0]['lse_max_abs_err']:.2g}, "
        f"tile_max rel err {t[0]['tile_max_max_rel_err']:.2g}; flips (count/LA/CA) paper "
        f"{t[0]['count_flips']}/{t[0]['la_flips']}/{t[0]['ca_flips']}, midpoint "
        f"{t[1]['count_flips']}/{t[1]['la_flips']}/{t[1]['ca_flips']} of {t[1]['la_bits']} LA bits "
        f"(LA density {t[1]['la_density']:.2f}, CA {t[1]['ca_density']:.2f})")
    return res


def checks(s: Setup) -> list[dict]:
    """The check cases: a Llama-3-8B layer's heads, GQA ratios, tiles, soft-capping, strides, one token."""
    cases = [
        dict(name="fp32 gqa4 d128 tile64", dtype=torch.float32, hq=8, hkv=2, d=128, n_prefix=1, n_doc=1500, tile=64),
        dict(name="fp32 mha d64 tile16 softcap", dtype=torch.float32, hq=4, hkv=4, d=64, n_prefix=5, n_doc=700,
             tile=16, softcap=30.0),
        dict(name="fp32 gqa3 tile32 key_index", dtype=torch.float32, hq=6, hkv=2, d=128, n_prefix=0, n_doc=999,
             tile=32, ca_normalize="key_index"),
        dict(name="bf16 llama tile64 strided", dtype=torch.bfloat16, hq=s.hq, hkv=s.hkv, d=D, n_prefix=1,
             n_doc=2500, tile=64, strided=True),
        dict(name="bf16 llama tile128", dtype=torch.bfloat16, hq=s.hq, hkv=s.hkv, d=D, n_prefix=3, n_doc=2000,
             tile=128),
        dict(name="bf16 gqa4 tile16", dtype=torch.bfloat16, hq=8, hkv=2, d=D, n_prefix=1, n_doc=1200, tile=16),
        dict(name="fp16 gqa4 tile32 softcap", dtype=torch.float16, hq=8, hkv=2, d=D, n_prefix=1, n_doc=1100,
             tile=32, softcap=50.0, strided=True),
        dict(name="bf16 one-token doc", dtype=torch.bfloat16, hq=s.hq, hkv=s.hkv, d=D, n_prefix=1, n_doc=1, tile=64),
    ]
    if s.smoke:
        cases = [dict(c, n_doc=min(c["n_doc"], 70), hq=min(c["hq"], 4), hkv=min(c["hkv"], 2),
                      dtype=torch.float16 if c["dtype"] == torch.bfloat16 else c["dtype"]) for c in cases]
    return cases


# ----------------------------------------------------------------------------------------------- 2. timing
def bench_ms(s: Setup, fn, n_ctx):
    """Median ms; fewer repetitions at long lengths (128K SDPA is ~0.24 s a call). --smoke: one call, NaN."""
    if s.smoke:
        fn()
        return float("nan")
    rep = 100 if n_ctx <= 8192 else 300 if n_ctx <= 32768 else 800
    return gpu_ms(fn, warmup=min(rep, 50), rep=rep)


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


def peak_mib(fn) -> float:
    """Peak memory fn allocates beyond what is allocated before it, MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def time_sdpa(s: Setup, row, q, k, v, lse, mine, args, n_doc):
    """The dense forwards of the layer (plain, and with the lse the profiler reads), and the bits the
    forward's lse gives against the kernel's own first pass."""
    n_prefix = args["n_prefix"]
    for source in ("flash", "cudnn"):
        try:
            fn, gqa = forward_with_lse(source, q, k, v)
            fwd_lse = fn()
            row[f"{source}_lse_max_abs_err"] = (fwd_lse[:, n_prefix:] - lse[:, n_prefix:]).abs().max().item()
            theirs, _ = pk.profile_layer(q, k, lse=fwd_lse, **args)
            row[f"bit_flips_with_{source}_lse"] = int((mine.la != theirs.la).sum() + (mine.ca != theirs.ca).sum())
            row[f"{source}_with_lse_ms"] = bench_ms(s, fn, n_doc)
            row[f"{source}_with_lse_gqa"] = gqa
        except Exception as e:  # noqa: BLE001 - a backend that does not run is reported, not fatal
            row[f"{source}_with_lse_error"] = f"{type(e).__name__}: {e}"[:300]
    causal_flops = 4.0 * q.shape[0] * D * q.shape[1] * (q.shape[1] + 1) / 2  # QK^T + PV
    for backend in ("cudnn", "flash"):
        try:
            fn, gqa = sdpa_fn(backend, q, k, v)
            row[f"{backend}_ms"] = bench_ms(s, fn, n_doc)
            row[f"{backend}_gqa"] = gqa
            row[f"{backend}_tflops"] = causal_flops / row[f"{backend}_ms"] / 1e9
        except Exception as e:  # noqa: BLE001
            row[f"{backend}_error"] = f"{type(e).__name__}: {e}"[:300]


def time_length(s: Setup, n_doc):
    n_prefix = 1
    lp = n_prefix + n_doc
    q, k = make_qk(s, lp, s.hq, s.hkv, D, s.dtype, seed=1)
    v = make_qk(s, lp, s.hkv, s.hkv, D, s.dtype, seed=2)[1]
    args = dict(scale=SCALE, n_prefix=n_prefix, tile=TILE, alpha=PAPER[0], beta=PAPER[1], gamma=PAPER[2])
    lse_cfg, stats_cfg = pk.default_configs(TILE, D, q.dtype)
    row = dict(n_doc=n_doc, n_ctx=lp, configs=[cfg_name(lse_cfg), cfg_name(stats_cfg)])

    def profile():
        return pk.profile_layer(q, k, **args)

    mine, _ = profile()
    if not s.smoke:
        row["profile_peak_mib"] = peak_mib(profile)
        row["qk_inputs_mib"] = (q.numel() + k.numel()) * 2 / 2**20
    row["profile_ms"] = bench_ms(s, profile, n_doc)
    lse2 = pk._launch_lse(q, k, n_prefix=n_prefix, scale=SCALE, softcap=None, cfg=lse_cfg)
    row["lse_pass_ms"] = bench_ms(
        s, lambda: pk._launch_lse(q, k, n_prefix=n_prefix, scale=SCALE, softcap=None, cfg=lse_cfg), n_doc)
    lse = torch.zeros(s.hq, lp, device=s.dev)
    lse[:, n_prefix:] = lse2 / LOG2E
    row["stats_and_bits_ms"] = bench_ms(s, lambda: pk.profile_layer(q, k, lse=lse, **args), n_doc)
    if not s.smoke:
        time_sdpa(s, row, q, k, v, lse, mine, args, n_doc)
    row["profile_tflops"] = 4.0 * s.hq * D * lp * (lp + 1) / 2 / row["profile_ms"] / 1e9
    # The builder's attention + bits per layer: cuDNN forward with its lse, then the stats pass and the bits.
    if "cudnn_with_lse_ms" in row:
        row["layer_ms"] = row["cudnn_with_lse_ms"] + row["stats_and_bits_ms"]
        if "cudnn_ms" in row:
            row["layer_over_cudnn"] = row["layer_ms"] / row["cudnn_ms"]
    for backend in ("cudnn", "flash"):
        if f"{backend}_ms" in row:
            row[f"profile_over_{backend}"] = row["profile_ms"] / row[f"{backend}_ms"]
            # With the forward's lse the builder only adds the stats pass (+ bits) to the attention it runs anyway.
            row[f"stats_over_{backend}"] = row["stats_and_bits_ms"] / row[f"{backend}_ms"]
    log(f"timing L={n_doc}: " + ", ".join(f"{key}={val:.3g}" if isinstance(val, float) else f"{key}={val}"
                                          for key, val in row.items() if key not in ("n_doc",)))
    del q, k, v, lse, lse2
    if not s.smoke:
        torch.cuda.empty_cache()
    return row


# ----------------------------------------------------------------------------------------------- 3. sweep
def sweep(s: Setup, n_doc: int, time_budget_s: float):
    """Launch parameters of each pass at one length; the stats configs' bits against the default's. Stops
    starting new configs once the script has run `time_budget_s`."""
    n_prefix = 1
    lp = n_prefix + n_doc
    q, k = make_qk(s, lp, s.hq, s.hkv, D, s.dtype, seed=3)
    args = dict(scale=SCALE, n_prefix=n_prefix, tile=TILE, alpha=PAPER[0], beta=PAPER[1], gamma=PAPER[2])
    default_lse, default_stats = pk.default_configs(TILE, D, q.dtype)
    ref_bits, _ = pk.profile_layer(q, k, **args)
    p = n_pages(n_doc, TILE)
    out = dict(n_doc=n_doc, lse=[], stats=[])
    lse_sweep, stats_sweep = (LSE_SWEEP[:1], STATS_SWEEP[:2]) if s.smoke else (LSE_SWEEP, STATS_SWEEP)
    for cfg in lse_sweep:
        if time.time() - T0 > time_budget_s:
            out["stopped_at_time_budget"] = True
            break
        try:
            pk._launch_lse(q, k, n_prefix=n_prefix, scale=SCALE, softcap=None, cfg=cfg)
            ms = bench_ms(s, lambda: pk._launch_lse(q, k, n_prefix=n_prefix, scale=SCALE, softcap=None, cfg=cfg),
                          n_doc)
            out["lse"].append(dict(config=cfg_name(cfg), ms=ms))
        except Exception as e:  # noqa: BLE001
            out["lse"].append(dict(config=cfg_name(cfg), error=f"{type(e).__name__}: {e}"[:300]))
        log(f"sweep lse {out['lse'][-1]}")
    lse2 = pk._launch_lse(q, k, n_prefix=n_prefix, scale=SCALE, softcap=None, cfg=default_lse)
    lse = torch.zeros(q.shape[0], lp, device=s.dev)
    lse[:, n_prefix:] = lse2 / LOG2E
    for cfg in stats_sweep:
        if time.time() - T0 > time_budget_s:
            out["stopped_at_time_budget"] = True
            break
        try:
            bits, _ = pk.profile_layer(q, k, lse=lse, configs=(default_lse, cfg), **args)
            flips = int((unpack_msb(bits.la, p * (p + 1) // 2) != unpack_msb(ref_bits.la, p * (p + 1) // 2)).sum()
                        + (unpack_msb(bits.ca, p) != unpack_msb(ref_bits.ca, p)).sum())
            ms = bench_ms(s, lambda: pk.profile_layer(q, k, lse=lse, configs=(default_lse, cfg), **args), n_doc)
            out["stats"].append(dict(config=cfg_name(cfg), ms=ms, bit_flips_vs_default=flips))
        except Exception as e:  # noqa: BLE001
            out["stats"].append(dict(config=cfg_name(cfg), error=f"{type(e).__name__}: {e}"[:300]))
        log(f"sweep stats+bits {out['stats'][-1]}")
    out["default"] = [cfg_name(default_lse), cfg_name(default_stats)]
    return out


# ----------------------------------------------------------------------------------------------- main
def print_table(result: dict) -> None:
    print("checks: " + ", ".join(f"{c['name']}={'ok' if c['ok'] else 'FAIL'}" for c in result["checks"]))
    if result["sweep"]:
        best = lambda rows: min((r for r in rows if "ms" in r), key=lambda r: r["ms"], default=None)  # noqa: E731
        print(f"sweep @{result['sweep']['n_doc']}: default {result['sweep']['default']}; best lse "
              f"{best(result['sweep']['lse'])}; best stats+bits {best(result['sweep']['stats'])}")
    print("profile = both passes + bits; stats = second pass + bits given the forward's lse; "
          "layer = cuDNN forward with lse + stats (the builder's attention + bits per layer); x = time / cuDNN")
    print(f"{'L':>7} {'profile ms':>10} {'lse ms':>8} {'stats ms':>9} {'cudnn ms':>9} {'flash ms':>9} "
          f"{'cudnn+lse':>9} {'flash+lse':>9} {'layer ms':>9} {'x cudnn':>8} {'stats x':>8} {'layer x':>8} "
          f"{'peak MiB':>9}")
    for r in result["timing"]:
        def f(key, w, fmt=".2f"):
            return f"{r[key]:{w}{fmt}}" if isinstance(r.get(key), float) else f"{'-':>{w}}"

        print(f"{r['n_doc']:>7} {f('profile_ms', 10)} {f('lse_pass_ms', 8)} {f('stats_and_bits_ms', 9)} "
              f"{f('cudnn_ms', 9)} {f('flash_ms', 9)} {f('cudnn_with_lse_ms', 9)} {f('flash_with_lse_ms', 9)} "
              f"{f('layer_ms', 9)} {f('profile_over_cudnn', 8)} {f('stats_over_cudnn', 8)} "
              f"{f('layer_over_cudnn', 8)} {f('profile_peak_mib', 9, '.0f')}")
    print(f"ok={result['ok']} elapsed {result['elapsed_s']:.0f}s; errors: {result['errors'] or 'none'}")


def run_all(s: Setup, lengths: list[int], sweep_len: int, time_budget_s: float) -> dict:
    result = dict(smoke=s.smoke, shape=dict(hq=s.hq, hkv=s.hkv, d=D, tile=TILE, dtype=str(s.dtype), n_prefix=1,
                                            scale=SCALE),
                  checks=[], timing=[], sweep=None, errors=[])
    failed = False
    for spec in checks(s):
        try:
            res = check_case(s, **spec)
            failed |= not res["ok"]
            result["checks"].append(res)
        except Exception as e:  # noqa: BLE001 - keep going, report at the end
            failed = True
            result["errors"].append(f"check {spec['name']}: {type(e).__name__}: {e}")
            log(f"check {spec['name']} FAILED:\n{traceback.format_exc()}")
        if not s.smoke:
            torch.cuda.empty_cache()
    for n in lengths:
        try:
            result["timing"].append(time_length(s, n))
        except Exception as e:  # noqa: BLE001
            failed = True
            result["errors"].append(f"timing L={n}: {type(e).__name__}: {e}")
            log(f"timing L={n} FAILED:\n{traceback.format_exc()}")
    try:
        result["sweep"] = sweep(s, sweep_len, time_budget_s)
    except Exception as e:  # noqa: BLE001
        result["errors"].append(f"sweep: {type(e).__name__}: {e}")
        log(f"sweep FAILED:\n{traceback.format_exc()}")
    result["elapsed_s"] = time.time() - T0
    result["ok"] = not failed
    return result


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048,8192,32768,131072", help="document lengths to time, comma-separated")
    ap.add_argument("--sweep-len", type=int, default=16384, help="document length of the launch-parameter sweep")
    ap.add_argument("--time-budget-s", type=float, default=195.0,
                    help="the sweep starts no new config after the script has run this long")
    args = ap.parse_args()
    if args.smoke:
        s, lengths, sweep_len = CPU_SMOKE, [100], 100
    elif not torch.cuda.is_available():
        raise SystemExit("bench_profile.py times CUDA kernels and no GPU is visible; use --smoke on CPU")
    else:
        s, lengths, sweep_len = GPU, [int(x) for x in args.lengths.split(",") if x], args.sweep_len
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be IEEE fp32
        torch.backends.cudnn.allow_tf32 = False
    result = run_all(s, lengths, sweep_len, args.time_budget_s)
    # A smoke run never replaces the measured result: it goes to results/smoke/ unless --out says otherwise.
    write_result("profile", result, args.out / "smoke" if s.smoke and args.out == RESULTS else args.out)
    print_table(result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
