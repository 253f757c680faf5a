"""The key pass (`_rotate_blocks_kernel`, keys to logical positions) against a plain copy of the same bytes
(`Tensor.copy_`, the floor any pass over a layer's keys has) and at 2 / 4 / 8 warps; the small launches the
launcher ran before the pass formed its own angles. One GPU, bf16, 8 KV heads,
head_dim 128, block 128, documents of 2048 tokens; do_bench medians (L2 flushed before each call). Writes
$OUT/pass_floor.json.

    PYTHONUNBUFFERED=1 python3 bench/pass_floor.py      # on the GPU machine, from the repo root
"""
from __future__ import annotations

import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checkout import use_checkout  # noqa: E402

use_checkout()
from sift.kernels import sparse_attention as sa  # noqa: E402


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("pass_floor.py times GPU kernels: run it on a CUDA machine")
    rows = []
    for L in (16384, 32768, 65536):
        k = torch.randn(8, L, 128, device="cuda", dtype=torch.bfloat16)
        nb = L // 128
        block_offset = (torch.arange(nb, device="cuda", dtype=torch.int32) // 16) * 2048
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32, device="cuda") / 128))
        out = torch.empty_like(k)
        row = dict(L=L, MiB_moved=2 * k.numel() * k.element_size() / 2**20)
        row["copy_us"] = triton.testing.do_bench(lambda: out.copy_(k), warmup=25, rep=200, return_mode="median") * 1e3
        ref = None
        for warps in (2, 4, 8):
            def run(w=warps):
                sa._rotate_blocks_kernel[(8, nb)](k, out, block_offset, inv_freq, out, *k.stride(), *out.stride(),
                                                  BLOCK=128, HALF=64, FAST_TRIG=True, WRITE_CS=False, num_warps=w)
            row[f"pass_w{warps}_us"] = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median") * 1e3
            run()
            torch.cuda.synchronize()
            if ref is None:
                ref = out.clone()
            else:
                row[f"w{warps}_equal"] = bool(torch.equal(out, ref))
        # What the attention launcher used to run around the pass before the pass formed its own fp64 angles:
        # inv_freq -> fp64 turns on the host side (a cast and a division, two launches) and, for pre-rotated
        # keys, a zero-filled turns vector (one launch). GPU time as CUDA graph replays.
        row["turns_launches_us"] = triton.testing.do_bench_cudagraph(lambda: sa._turns(inv_freq, "cuda"), rep=100,
                                                                     return_mode="median") * 1e3
        row["zero_turns_us"] = triton.testing.do_bench_cudagraph(
            lambda: torch.zeros(64, dtype=torch.float64, device="cuda"), rep=100, return_mode="median") * 1e3
        row["copy_TBps"] = row["MiB_moved"] * 2**20 / row["copy_us"] / 1e6
        row["pass_w4_TBps"] = row["MiB_moved"] * 2**20 / row["pass_w4_us"] / 1e6
        print(json.dumps({k_: round(v, 2) if isinstance(v, float) else v for k_, v in row.items()}), flush=True)
        rows.append(row)
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "pass_floor.json"), "w") as fh:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
