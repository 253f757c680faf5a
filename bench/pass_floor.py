"""The key pass (`rope.rotate_key_blocks`: keys to logical positions) against a plain copy of the same bytes
(`Tensor.copy_`, the floor any pass over a layer's keys has), at 2 / 4 / 8 warps; writes
bench/results/key-pass-floor.json.

    python bench/pass_floor.py [--lengths 16384,32768,65536]
    python bench/pass_floor.py --smoke     # CPU, Triton interpreter, tiny shapes: the script runs

bf16, 8 KV heads, head_dim 128, block 128, documents of 2048 tokens; do_bench medians (L2 flushed before each
call).
"""
from __future__ import annotations

import json

from common import gpu_ms, out_dir, parser, smoke_env, write_result

SMOKE = smoke_env()

import torch  # noqa: E402

from sift.kernels import rope  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
BLOCK, HKV, D = 128, 8, 128


def ms(fn) -> float:
    if SMOKE:
        fn()
        return float("nan")
    return gpu_ms(fn, rep=200)


def measure(L: int) -> dict:
    k = torch.randn(HKV, L, D, device=DEV, dtype=torch.float16 if SMOKE else torch.bfloat16)
    nb = L // BLOCK
    block_offset = (torch.arange(nb, device=DEV, dtype=torch.int32) // 16) * 2048
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float32, device=DEV) / D))
    out = torch.empty_like(k)
    row = dict(L=L, MiB_moved=2 * k.numel() * k.element_size() / 2**20)
    row["copy_us"] = ms(lambda: out.copy_(k)) * 1e3
    ref = None
    for warps in (2, 4, 8):
        def run(w=warps):
            rope._rotate_blocks_kernel[(HKV, nb)](k, out, block_offset, inv_freq, out, *k.stride(), *out.stride(),
                                                  BLOCK=BLOCK, HALF=D // 2, FAST_TRIG=not SMOKE, WRITE_CS=False,
                                                  num_warps=w)
        row[f"pass_w{warps}_us"] = ms(run) * 1e3
        run()
        if ref is None:
            ref = out.clone()
        else:
            row[f"w{warps}_equal"] = bool(torch.equal(out, ref))
    row["copy_TBps"] = row["MiB_moved"] * 2**20 / row["copy_us"] / 1e6
    row["pass_w4_TBps"] = row["MiB_moved"] * 2**20 / row["pass_w4_us"] / 1e6
    return row


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="16384,32768,65536", help="context lengths (tokens), comma-separated")
    args = ap.parse_args()
    if not SMOKE and not torch.cuda.is_available():
        raise SystemExit("pass_floor.py times GPU kernels: run it on a CUDA machine (or --smoke)")
    rows = []
    for L in [256] if SMOKE else [int(x) for x in args.lengths.split(",")]:
        rows.append(measure(L))
        print(json.dumps({k_: round(v, 2) if isinstance(v, float) else v for k_, v in rows[-1].items()}), flush=True)
    write_result("key-pass-floor", dict(shapes=dict(Hkv=HKV, D=D, block=BLOCK, dtype="bf16"), rows=rows),
                 out_dir(args))


if __name__ == "__main__":
    main()
