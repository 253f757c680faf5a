"""y = x @ W^T (+ bias) for a few rows of x, streaming W at the memory bandwidth; and its ref twin.

A decode step at a small batch multiplies a handful of activation rows x [M, K] by each projection's weight
W [N, K] (row-major, as nn.Linear stores it): the product is bound by W's bytes, and what matters is keeping
enough of them in flight to reach the memory's bandwidth. A general GEMM library picks tiles for a square problem
or splits K over several thread blocks and reduces their partial sums in a second kernel. Here each program owns
BLOCK_N output columns (BLOCK_N rows of W) and walks all of K in BLOCK_K chunks, every load a [BLOCK_N, BLOCK_K]
tile of W, contiguous along K; the accumulation is fp32 and the result is rounded once to x's dtype after the
bias is added (what F.linear computes). One kernel, no atomics, no buffer to zero: capture-safe.

Two ways to multiply a tile (`GemvConfig.dot`):
    dot=True    tl.dot of x (its M rows padded to 16, the smallest the tensor cores take) with the tile
                transposed; the loop's loads are software-pipelined over `num_stages` tiles.
    dot=False   x [M_pad, 1, BLOCK_K] * tile [1, BLOCK_N, BLOCK_K] summed over K in registers, M_pad the next
                power of two >= M: no padding work, registers grow with M.
Which is faster, and with which tile, depends on the shape, M and the device: bench/bench_gemv.py measures them
against cuBLAS, and runtime/llama_decode.py chooses per projection shape and batch rows on the engine's device.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .device import triton_runs_on

MAX_ROWS = 16           # x rows the kernel takes: a decode batch; beyond it the product is a GEMM
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """One schedule of the kernel: the output columns and the K chunk of each program's tiles, its warps, its
    pipeline stages and how a tile is multiplied (module docstring)."""

    block_n: int = 64
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = True

    @property
    def name(self) -> str:
        return f"n{self.block_n}k{self.block_k}w{self.num_warps}s{self.num_stages}{'d' if self.dot else 'f'}"


@triton.jit(do_not_specialize=["M"])       # one compiled kernel for every row count of a BLOCK_M
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, x_stride, w_stride, y_stride,
                 HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, DOT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)            # output columns = rows of W
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < N
    row_ok = rows < M
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * w_stride + ks[None, :]
    x_ptrs = x_ptr + rows[:, None] * x_stride + ks[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k_ok = (k0 + ks) < K
        w = tl.load(w_ptrs + k0, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT:
            if IEEE:
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rows[:, None] * y_stride + cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel: bool = True) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv takes x [M, K] and weight [N, K] (got {tuple(x.shape)} and {tuple(weight.shape)})")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"gemv takes 1 to {MAX_ROWS} rows of x (got {x.shape[0]}); use F.linear for more")
    if x.dtype not in DTYPES or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"gemv takes x, weight and bias of one dtype among float32 / float16 / bfloat16 (got "
                         f"{x.dtype}, {weight.dtype}, {None if bias is None else bias.dtype})")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"gemv's bias must be [N] = [{weight.shape[0]}] (got {tuple(bias.shape)})")
    if kernel and not triton_runs_on(x.device):
        raise ValueError(f"gemv runs on CUDA tensors (got {x.device}); use gemv_ref on CPU")


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig = GemvConfig()) -> torch.Tensor:
    """x [M, K] (1 <= M <= MAX_ROWS), weight [N, K], bias [N] or None, one dtype -> y = x @ weight^T + bias
    [M, N] in x's dtype, accumulated in fp32 and rounded once. Launches one kernel (capture-safe)."""
    _check(x, weight, bias)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        raise ValueError("gemv reads weight's rows contiguously: pass weight.contiguous()")
    m, n, k = x.shape[0], weight.shape[0], x.shape[1]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = max(16, triton.next_power_of_2(m)) if config.dot else triton.next_power_of_2(m)
    block_k = min(config.block_k, max(16, triton.next_power_of_2(k)))
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, bias if bias is not None else y, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, DOT=config.dot, BLOCK_M=block_m,
        BLOCK_N=config.block_n, BLOCK_K=block_k, NUM_STAGES=config.num_stages, num_warps=config.num_warps)
    return y


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             config: GemvConfig | None = None) -> torch.Tensor:
    """The twin of `gemv`, in torch: the product and the bias in fp32, rounded once to x's dtype."""
    _check(x, weight, bias, kernel=False)
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# The schedules an engine chooses among on its own device (runtime/llama_decode.py `LlamaDecode.linear`): few, so
# that choosing costs a few compiles at warm-up; bench/bench_gemv.py times them beside a wider grid and cuBLAS.
CANDIDATES = (GemvConfig(32, 256, 4, 3, True), GemvConfig(64, 256, 4, 3, True), GemvConfig(16, 512, 4, 4, True),
              GemvConfig(8, 256, 4, 2, False))


def fastest(x: torch.Tensor, weights: list[tuple[torch.Tensor, torch.Tensor | None]],
            configs: tuple[GemvConfig, ...] = CANDIDATES, reps: int = 3) -> tuple[GemvConfig | None, dict]:
    """The faster way to compute F.linear(x, w, b) for x [M, K] on its CUDA device, over `weights`: (w, b) pairs
    of one shape (the same projection of every layer, so the product streams each weight from memory as a decode
    step does): None (F.linear, cuBLAS) or the fastest of `configs`. Each way runs once (compiling), then is
    captured in a CUDA graph of one call per pair (the host's launch cost out of the figure, as in a captured
    step) and timed over `reps` replays; a config that fails to compile or errs is left out.
    -> (choice, {name: us per call}), name "cublas" or the config's name. Not during a capture."""
    ways = {"cublas": (None, lambda w, b: torch.nn.functional.linear(x, w, b))}
    ways.update({c.name: (c, lambda w, b, c=c: gemv(x, w, b, c)) for c in configs})
    times = {}
    stream = torch.cuda.Stream(x.device)      # warm-up and capture on one stream (cuBLAS' workspace is per stream)
    for name, (_, call) in ways.items():
        try:
            stream.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(stream):
                call(*weights[0])
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for w, b in weights:
                    call(w, b)
        except (RuntimeError, ValueError, triton.CompilationError, triton.runtime.errors.OutOfResources):
            continue
        graph.replay()
        runs = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end) * 1e3 / len(weights))
        del graph
        times[name] = sorted(runs)[len(runs) // 2]
    if not times:
        return None, times
    return ways[min(times, key=times.get)][0], times      # a tie goes to cuBLAS, listed first
