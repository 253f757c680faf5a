"""Compile `_sparse_attn_fwd` for sm_90 without a GPU and print registers, spills and shared memory per config.

    python bench/aot_sm90.py                       # the default configs, RoPE modes "pre" / "k" and pre-rotated
    python bench/aot_sm90.py 128,8,2,pre,0,1 128,8,3,k   # block_n,warps,stages,rope_on[,q_reload,pre_via_out]
    python bench/aot_sm90.py gluon                 # the Gluon Hopper kernel (kernels/sparse_attention_sm90.py)

Uses Triton's own ptxas (shipped in the wheel) on the PTX the JIT would build for an H100/H200 (bf16, head_dim
128, block 128, GQA 4, unit last strides, 16-divisible pointers and strides). A spill in the steady loop or a
shared-memory total over 227 KiB shows here before any GPU time is spent; speed still needs the GPU.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
ROOT = Path(__file__).resolve().parents[1]
from _checkout import use_checkout  # noqa: E402

use_checkout()
from sift.kernels import sparse_attention as sa  # noqa: E402

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

POINTERS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "Indptr": "*i32", "RowEnd": "*i32",
            "Indices": "*i32", "BlockValid": "*i32", "BlockOffset": "*i32", "QTokStart": "*i32", "Turns": "*fp64"}
ROPE = {None: sa.ROPE_NONE.value, "k": sa.ROPE_ON_K.value, "q": sa.ROPE_ON_Q.value, "pre": sa.ROPE_PRE.value}


def compile_sm90(cfg: sa.KernelConfig, rope_on: str | None, *, head_dim: int = 128, block: int = 128,
                 group: int = 4, q_tokens: bool = False):
    fn = sa._sparse_attn_fwd
    sig, attrs, const = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in POINTERS:
            sig[name], attrs[(i,)] = POINTERS[name], [["tt.divisibility", 16]]
        elif name.startswith("stride_") and name.endswith("d"):
            sig[name], const[name] = "constexpr", 1
        elif name.startswith("stride_"):
            sig[name], attrs[(i,)] = "i32", [["tt.divisibility", 16]]
        elif name == "NB":
            sig[name] = "i32"
        elif name == "qk_scale":
            sig[name] = "fp32"
    const.update(GROUP=group, BLOCK=block, BLOCK_N=cfg.block_n, HEAD_DIM=head_dim, ROPE=ROPE[rope_on],
                 Q_RELOAD=cfg.q_reload, Q_TOKENS=q_tokens, PRE_VIA_OUT=cfg.pre_via_out, DOT_PRECISION="tf32",
                 FAST_TRIG=True)
    missing = set(fn.arg_names) - set(sig) - set(const)
    if missing:
        raise SystemExit(f"aot_sm90.py does not know the kernel arguments {sorted(missing)}: update POINTERS")
    for name in const:
        sig[name] = "constexpr"
    target = GPUTarget("cuda", 90, 64)
    options = triton.compiler.make_backend(target).parse_options(dict(num_warps=cfg.num_warps,
                                                                      num_stages=cfg.num_stages))
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs), target=target,
                          options=options.__dict__)


def ptxas_report(ptx: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.ptx"
        path.write_text(ptx)
        r = subprocess.run([triton.knobs.nvidia.ptxas.path, "-v", "--gpu-name=sm_90a", str(path), "-o",
                            str(path.with_suffix(".o"))], capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    return (f"{regs.group(1) if regs else '?'} registers, spills {spill.group(1) if spill else '?'} B stored / "
            f"{spill.group(2) if spill else '?'} B loaded")


def main(argv: list[str]) -> None:
    if argv == ["gluon"]:  # the warp-specialised Hopper kernel (kernels/sparse_attention_sm90.py)
        from sift.kernels import sparse_attention_sm90 as sm90
        for rope, q_tokens in ((True, True), (False, False)):
            kernel = sm90.compile_for_sm90(rope=rope, q_tokens=q_tokens)
            print(f"gluon rope={rope} q_tokens={q_tokens}: shared memory {kernel.metadata.shared} B, "
                  f"{ptxas_report(kernel.asm['ptx'])}", flush=True)
        return
    if argv:
        configs = []
        for spec in argv:
            f = spec.split(",")
            configs.append(sa.KernelConfig(int(f[0]), int(f[1]), int(f[2]), f[3], *(x == "1" for x in f[4:])))
    else:
        configs = [sa.default_config(128, 128), sa.KernelConfig(128, 8, 2, "k")]
    for cfg in configs:
        for rope_on in (cfg.rope_on, None):
            kernel = compile_sm90(cfg, rope_on)
            print(f"{cfg} rope={rope_on}: shared memory {kernel.metadata.shared} B, {ptxas_report(kernel.asm['ptx'])}",
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
