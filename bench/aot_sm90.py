"""Compile the attention kernels for sm_90 without a GPU and print registers, spills and shared memory.

    python bench/aot_sm90.py          # the tl kernel: default configs at block 128 ("pre") and 64 ("k"), with
                                      # RoPE, with pre-rotated keys, and computing only listed query blocks
    python bench/aot_sm90.py gluon    # the Gluon Hopper kernel (kernels/sparse_attention_sm90.py), with and
                                      # without the q_blocks variant

Uses Triton's own ptxas (shipped in the wheel) on the PTX the JIT would build for an H100/H200 (bf16, head_dim
128, GQA 4, unit last strides, 16-divisible pointers and strides). A spill in the steady loop or a shared-memory
total over 227 KiB shows here before any GPU time is spent; speed still needs the GPU. Exit status 1 if a kernel
needs more shared memory than an sm_90 SM gives one block (227 KiB).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)   # before triton is imported: compile, do not interpret

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from sift.kernels import sparse_attention_sm90 as sm90  # noqa: E402
from sift.kernels import sparse_attention_tl as tlk  # noqa: E402

POINTERS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "Indptr": "*i32", "RowEnd": "*i32",
            "Indices": "*i32", "BlockValid": "*i32", "BlockOffset": "*i32", "QBlocks": "*i32", "QTokStart": "*i32",
            "InvFreq": "*fp32", "KVPages": "*i32"}
ROPE = {None: tlk.ROPE_NONE.value, "k": tlk.ROPE_ON_K.value, "pre": tlk.ROPE_PRE.value}
SMEM_LIMIT = 227 * 1024  # bytes of shared memory one block may use on sm_90


def compile_tl(cfg: tlk.AttentionConfig, rope_on: str | None, *, block: int, head_dim: int = 128, group: int = 4,
               q_tokens: bool = False, q_blocks: bool = False):
    """The tl kernel `_sparse_attn_fwd` compiled for sm_90 with launch parameters cfg (rope_on None: pre-rotated;
    q_tokens, q_blocks: the Q_TOKENS / Q_BLOCKS variants)."""
    fn = tlk._sparse_attn_fwd
    sig, attrs, const = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in POINTERS:
            sig[name], attrs[(i,)] = POINTERS[name], [["tt.divisibility", 16]]
        elif name.startswith("stride_") and name.endswith("d"):
            sig[name], const[name] = "constexpr", 1
        elif name.startswith("stride_"):
            sig[name], attrs[(i,)] = "i32", [["tt.divisibility", 16]]
        elif name == "NQ":
            sig[name] = "i32"
        elif name == "qk_scale":
            sig[name] = "fp32"
    const.update(GROUP=group, BLOCK=block, HEAD_DIM=head_dim, ROPE=ROPE[rope_on], Q_TOKENS=q_tokens,
                 Q_BLOCKS=q_blocks, K_PAGED=False, V_PAGED=False, DOT_PRECISION="tf32", FAST_TRIG=True)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel", nargs="?", choices=("tl", "gluon"), default="tl", help="which kernel to compile")
    args = ap.parse_args()
    over = []

    def report(name: str, kernel) -> None:
        shared = kernel.metadata.shared
        print(f"{name}: shared memory {shared} B, {ptxas_report(kernel.asm['ptx'])}", flush=True)
        if shared > SMEM_LIMIT:
            over.append(f"{name} ({shared} B)")

    if args.kernel == "gluon":
        for rope, q_tokens, q_blocks in ((True, True, False), (False, False, False), (True, True, True)):
            report(f"gluon rope={rope} q_tokens={q_tokens} q_blocks={q_blocks}",
                   sm90.compile_for_sm90(rope=rope, q_tokens=q_tokens, q_blocks=q_blocks))
    else:
        for block in (128, 64):
            cfg = tlk.default_config(block)
            for rope_on, q_blocks in ((cfg.rope_on, False), (None, False), (cfg.rope_on, True)):
                report(f"tl block={block} {cfg} rope={rope_on} q_blocks={q_blocks}",
                       compile_tl(cfg, rope_on, block=block, q_blocks=q_blocks))
    if over:
        raise SystemExit(f"over the {SMEM_LIMIT} B of shared memory an sm_90 block may use: {', '.join(over)}")


if __name__ == "__main__":
    main()
