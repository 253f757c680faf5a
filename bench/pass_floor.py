"""The key pass (`rope.rotate_key_blocks`: keys to logical positions) against a plain copy of the same bytes
(`Tensor.copy_`, the floor any pass over a layer's keys has), at 2 / 4 / 8 warps; writes
bench/results/key-pass-floor.json.

    python bench/pass_floor.py [--lengths 16384,32768,65536]
    python bench/pass_floor.py --smoke     # CPU, Triton interpreter, tiny shapes: the script runs

bf16, 8 KV heads, head_dim 128, block 128, documents of 2048 tokens; do_bench medians (L2 flushed before each
call). Before it is timed, each launch shape's output is checked against the ref twin `rotate_key_blocks_ref`
(relative error per (head, block) within c * u * sqrt(depth), bench/common.py `Checks`); exit status 1 after
writing the result if a check failed.
"""
from __future__ import annotations

import json

from common import Checks, gpu_ms, out_dir, parser, smoke_env, write_result

SMOKE = smoke_env()

import torch  # noqa: E402

from sift.kernels import rope  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
BLOCK, HKV, D = 128, 8, 128
DTYPE = torch.float16 if SMOKE else torch.bfloat16  # bf16 is broken in the interpreter
# The pass rotates with fast (approximate) sin / cos and rounds its output; the twin rotates with fp64 angles and
# rounds once: two roundings' worth and the trigonometry's error, which stays below one.
DEPTH_KEY_PASS = 3


def ms(fn) -> float:
    if SMOKE:
        fn()
        return float("nan")
    return gpu_ms(fn, rep=200)


def measure(L: int, checks: Checks) -> dict:
    k = torch.randn(HKV, L, D, device=DEV, dtype=DTYPE)
    nb = L // BLOCK
    doc_blocks = 1 if SMOKE else 2048 // BLOCK   # --smoke: one-block documents, so that some block is rotated
    block_offset = (torch.arange(nb, device=DEV, dtype=torch.int32) // doc_blocks) * (doc_blocks * BLOCK)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float32, device=DEV) / D))
    out = torch.empty_like(k)
    row = dict(L=L, MiB_moved=2 * k.numel() * k.element_size() / 2**20)
    row["copy_us"] = ms(lambda: out.copy_(k)) * 1e3
    ref = rope.rotate_key_blocks_ref(k, block_offset, inv_freq, block=BLOCK)
    for warps in (2, 4, 8):
        def run(w=warps):  # `rope.rotate_key_blocks`' launch at `w` warps
            rope._rotate_blocks_kernel[(HKV, nb)](k, out, block_offset, inv_freq, out, block_offset, *k.stride(),
                                                  *out.stride(), BLOCK=BLOCK, HALF=D // 2, FAST_TRIG=not SMOKE,
                                                  WRITE_CS=False, PAGED=False, num_warps=w)
        out.fill_(float("nan"))
        run()
        checks.close(f"key_pass/{L}/w{warps}", out.unflatten(1, (nb, BLOCK)), ref.unflatten(1, (nb, BLOCK)), DTYPE,
                     DEPTH_KEY_PASS, group_dims=2)
        row[f"pass_w{warps}_us"] = ms(run) * 1e3
    row["copy_TBps"] = row["MiB_moved"] * 2**20 / row["copy_us"] / 1e6
    row["pass_w4_TBps"] = row["MiB_moved"] * 2**20 / row["pass_w4_us"] / 1e6
    return row


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="16384,32768,65536", help="context lengths (tokens), comma-separated")
    args = ap.parse_args()
    if not SMOKE and not torch.cuda.is_available():
        raise SystemExit("pass_floor.py times GPU kernels: run it on a CUDA machine (or --smoke)")
    rows, checks = [], Checks()
    for L in [256] if SMOKE else [int(x) for x in args.lengths.split(",")]:
        rows.append(measure(L, checks))
        print(json.dumps({k_: round(v, 2) if isinstance(v, float) else v for k_, v in rows[-1].items()}), flush=True)
    write_result("key-pass-floor", dict(shapes=dict(Hkv=HKV, D=D, block=BLOCK, dtype=str(DTYPE).removeprefix("torch.")),
                                        rows=rows, checks=checks.to_json(), ok=checks.ok), out_dir(args))
    raise SystemExit(checks.exit_status())


if __name__ == "__main__":
    main()
