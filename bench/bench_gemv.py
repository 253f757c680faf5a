"""GPU benchmark of the few-row matrix product (kernels/gemv.py) against cuBLAS, on the decode step's projections
of an 8B Llama (bf16): q / k / v stacked [6144 x 4096], o_proj [4096 x 4096], gate / up stacked [28672 x 4096],
down [4096 x 14336] and the lm_head [128256 x 4096], at M = 1, 2, 4, 8 rows.

For each shape and M: torch F.linear (cuBLAS, torch's default BLAS choice), F.linear with cuBLASLt preferred
(`torch.backends.cuda.preferred_blas_library`, restored afterwards), and the Triton kernel under each schedule of
GRID (each checked against its ref twin first, relative error within c * u * sqrt(depth): bench/common.py).
Times are device microseconds per call with the host's launch cost hidden (bench_decode.py `queued_us`), twice:
`hot`, the same weight every call (small weights then stay in L2), and `cold`, rotating over copies of the weight
whose total is at least COLD_BYTES (several times the L2), as a decode step streams each layer's weight from
memory. The floor is the weight's bytes over the bandwidth of a large device-to-device copy in the same run. The
table ranks by the cold time; `engine` is the best of the schedules the engine chooses among (kernels/gemv.py
CANDIDATES), which should be close to the best of the grid. Writes bench/results/gemv.json.

    python bench/bench_gemv.py [--shapes qkv,o_proj,gate_up,down,lm_head] [--rows 1,2,4,8]
    python bench/bench_gemv.py --smoke      # CPU, Triton interpreter, tiny shapes: the checks only
"""
from __future__ import annotations

import math

from common import Checks, out_dir, parser, smoke_env, write_result

SMOKE = smoke_env()  # before the kernels import triton

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from sift.kernels.gemv import CANDIDATES, GemvConfig, gemv, gemv_ref  # noqa: E402
from bench_decode import queued_us  # noqa: E402
from bench_generate import copy_bandwidth  # noqa: E402

SHAPES = {   # name: (N, K)
    "qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
    "lm_head": (128256, 4096)}
SMOKE_SHAPES = {"qkv": (96, 64), "o_proj": (64, 64), "gate_up": (200, 64), "down": (64, 136), "lm_head": (300, 64)}
DTYPE = torch.float16 if SMOKE else torch.bfloat16  # bf16 is broken in the interpreter
COLD_BYTES = 256 << 20
# Schedules timed: block_n x block_k x warps x stages, tensor-core tiles (d) and register sums (f); CANDIDATES
# among them. At most 16, so that the compiles and the timing stay within a minute and a half on an H200.
GRID = tuple(dict.fromkeys(CANDIDATES + (
    GemvConfig(32, 512, 4, 3, True), GemvConfig(64, 128, 4, 4, True), GemvConfig(64, 512, 8, 2, True),
    GemvConfig(128, 128, 8, 3, True), GemvConfig(32, 256, 4, 5, True), GemvConfig(16, 256, 4, 4, True),
    GemvConfig(16, 256, 4, 2, False), GemvConfig(32, 128, 4, 2, False), GemvConfig(4, 512, 4, 2, False),
    GemvConfig(8, 512, 8, 3, False), GemvConfig(16, 128, 4, 3, False))))
# Compiles: a tensor-core schedule once (x padded to 16 rows whatever M), a register one once per power of two
# of M; with M = 1, 2, 4, 8 about 9 + 4 * 6 kernels.
# The kernel's output and its twin's are each rounded once to DTYPE from fp32 sums in different orders.
DEPTH = 2
CALLS = 40   # calls per timed run: the spin covers their host launches (a few ms)
SPIN = 10_000_000   # ~5 ms of spinning: more than the host takes to launch CALLS calls


def timed(call, weights) -> float:
    """Device us per call, rotating over `weights` [(w, b)] (one pair: the hot figure)."""
    state = {"i": 0}

    def step():
        w, b = weights[state["i"] % len(weights)]
        state["i"] += 1
        call(w, b)
    return queued_us(step, n=CALLS, spin=SPIN, reps=3)


def cublaslt(call):
    """`call` with cuBLASLt preferred for the duration."""
    def run(w, b):
        previous = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            return call(w, b)
        finally:
            torch.backends.cuda.preferred_blas_library(previous)
    return run


def one(name: str, n: int, k: int, m: int, dev, bandwidth: float, checks: Checks) -> dict:
    gen = torch.Generator().manual_seed(n + k + m)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DTYPE).to(dev)
    x = torch.randn(m, k, generator=gen).to(DTYPE).to(dev)
    copies = max(1, math.ceil(COLD_BYTES / w.nbytes)) if not SMOKE else 2
    cold = [(w, None)] + [(w.clone(), None) for _ in range(copies - 1)]
    hot = [(w, None)]
    ref = gemv_ref(x, w)
    linear = lambda w_, b_: F.linear(x, w_, b_)   # noqa: E731
    ways = {"cublas": linear}
    if not SMOKE:
        ways["cublaslt"] = cublaslt(linear)
    ok_configs = []
    for c in GRID:
        try:
            out = gemv(x, w, None, c)
        except Exception as e:  # noqa: BLE001 - a schedule the device cannot compile is reported, not fatal
            print(f"  {name} M={m} {c.name}: {type(e).__name__}: {str(e).splitlines()[0][:100]}", flush=True)
            continue
        if checks.close(f"{name}_m{m}_{c.name}", out, ref, DTYPE, DEPTH):
            ok_configs.append(c)
            ways[c.name] = lambda w_, b_, c=c: gemv(x, w_, b_, c)
    checks.close(f"{name}_m{m}_cublas", linear(w, None), ref, DTYPE, DEPTH)
    times = {way: {"hot_us": timed(call, hot), "cold_us": timed(call, cold)} for way, call in ways.items()}
    del cold
    floor_us = w.nbytes / bandwidth * 1e6
    triton_names = [c.name for c in ok_configs]
    rank = (lambda t: times[t]["cold_us"]) if not SMOKE else (lambda t: 0)
    best = min(triton_names, key=rank) if triton_names else None
    engine = min([c.name for c in CANDIDATES if c.name in triton_names], key=rank, default=None)
    return dict(shape=name, n=n, k=k, m=m, weight_bytes=w.nbytes, cold_copies=copies, floor_us=floor_us,
                times=times, best=best, engine_best=engine)


def gbs(nbytes: int, us: float) -> float:
    return nbytes / us / 1e3


def table(results: list[dict]) -> None:
    print(f"\n{'shape':8} {'M':>2} {'best triton':>16} {'hot':>7} {'cold':>7} {'GB/s':>6} | {'cuBLAS':>7} "
          f"{'GB/s':>6} {'hot':>7} | {'Lt':>7} | {'engine set':>16} {'cold':>7} | {'floor':>7} {'win':>6}")
    for r in results:
        t, nb = r["times"], r["weight_bytes"]
        b, e = r["best"], r["engine_best"]
        nan = {"hot_us": math.nan, "cold_us": math.nan}
        tb, te, cb, lt = t.get(b, nan), t.get(e, nan), t["cublas"], t.get("cublaslt", nan)
        print(f"{r['shape']:8} {r['m']:>2} {str(b):>16} {tb['hot_us']:7.1f} {tb['cold_us']:7.1f} "
              f"{gbs(nb, tb['cold_us']):6.0f} | {cb['cold_us']:7.1f} {gbs(nb, cb['cold_us']):6.0f} "
              f"{cb['hot_us']:7.1f} | {lt['cold_us']:7.1f} | {str(e):>16} {te['cold_us']:7.1f} | "
              f"{r['floor_us']:7.1f} {cb['cold_us'] / tb['cold_us']:6.2f}")
    print("us per call (device, host launch hidden); cold: rotating over copies of the weight beyond the L2; "
          "win: cuBLAS cold / best Triton cold")


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, among " + ",".join(SHAPES))
    ap.add_argument("--rows", default="1,2,4,8", help="comma-separated row counts M")
    args = ap.parse_args()
    dev = torch.device("cpu" if SMOKE else "cuda")
    shapes = SMOKE_SHAPES if SMOKE else SHAPES
    bandwidth = copy_bandwidth(SMOKE)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; {len(GRID)} schedules", flush=True)
    checks = Checks()
    results = []
    for name in args.shapes.split(","):
        n, k = shapes[name]
        for m in map(int, args.rows.split(",")):
            results.append(one(name, n, k, m, dev, bandwidth, checks))
            print(f"{name} M={m}: best {results[-1]['best']}", flush=True)
    table(results)
    write_result("gemv", {"setup": dict(dtype=str(DTYPE), copy_bandwidth=bandwidth, cold_bytes=COLD_BYTES,
                                        grid=[c.name for c in GRID], candidates=[c.name for c in CANDIDATES]),
                          "results": results, "checks": checks.to_json()}, out_dir(args))
    raise SystemExit(checks.exit_status())


if __name__ == "__main__":
    main()
