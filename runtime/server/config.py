"""What `sift-serve` serves (`ServeConfig`, frozen, validated once) and how one engine replica is made from it
(`make_worker`): the model, the index, the KV store and the engine on this process's device."""
from __future__ import annotations

import sys
from dataclasses import dataclass

from sift.errors import SiftError

from .protocol import ServerDefaults

MODES = ("sift", "dense", "reuse", "hybrid")
# The KV store's pool when --kv-hbm-gib is left out: on a GPU this share of the memory free once the model is
# loaded (the rest holds the forwards' activations); on CPU a fixed budget.
AUTO_HBM_SHARE = 0.5
AUTO_CPU_GIB = 1.0
# A process serving an engine runs its step loop and the HTTP event loop on two threads that share the GIL; a
# thread waiting for it waits up to the interpreter's switch interval (5 ms by default) at every hand-over, which
# would add milliseconds to every token's way out. Half a millisecond keeps the hand-overs short.
SWITCH_INTERVAL_S = 0.0005


@dataclass(frozen=True)
class ServeConfig:
    """index: the index path or URI; model: the served model (None: the index's); mode: the engine mode of
    requests that name none (`sift_mode`); kv_hbm_gib: the KV pool (None: automatic); kv_dram_gib: the pinned
    DRAM tier; max_queue: requests waiting per replica before 503; timeout_s: per-request timeout; device /
    dtype: "auto" (CUDA and bfloat16 where a GPU is visible, else CPU and float32) or explicit; max_tokens_chat:
    a chat request's max_tokens when it gives none."""

    index: str
    model: str | None = None
    mode: str = "sift"
    kv_hbm_gib: float | None = None
    kv_dram_gib: float = 0.0
    max_queue: int = 64
    timeout_s: float = 600.0
    device: str = "auto"
    dtype: str = "auto"
    max_tokens_chat: int = 256

    def __post_init__(self):
        if self.mode.partition(":")[0] not in MODES:
            raise SiftError(f"--mode {self.mode!r} must be one of {', '.join(MODES)} (or hybrid:<policy>[@<f>])")
        if self.kv_hbm_gib is not None and not self.kv_hbm_gib > 0:
            raise SiftError(f"--kv-hbm-gib {self.kv_hbm_gib} must be > 0")
        if self.kv_dram_gib < 0:
            raise SiftError(f"--kv-dram-gib {self.kv_dram_gib} must be >= 0")
        if self.max_queue < 1:
            raise SiftError(f"--max-queue {self.max_queue} must be >= 1")
        if not self.timeout_s > 0:
            raise SiftError(f"--timeout {self.timeout_s} must be > 0")
        if self.max_tokens_chat < 1:
            raise SiftError(f"--max-tokens-default {self.max_tokens_chat} must be >= 1")

    @property
    def defaults(self) -> ServerDefaults:
        return ServerDefaults(mode=self.mode, max_tokens_chat=self.max_tokens_chat, timeout_s=self.timeout_s)


def tune_process() -> None:
    """Process-wide settings of a process that serves an engine (its entrypoint calls this once)."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SiftError("--device cuda but no CUDA device is visible: use --device cpu")
    return device


def make_engine(cfg: ServeConfig):
    """-> (SiftEngine, its tokenizer, the served model's name) on this process's device."""
    import torch

    from sift.model import load_model, resolve_dtype
    from ..engine import SiftEngine
    from ..kv_store import KVStore
    from ..store import SiftIndex

    device = resolve_device(cfg.device)
    index = SiftIndex.open(cfg.index, device=device)
    name = cfg.model or index.model_name
    model, tokenizer, _ = load_model(name, dtype=resolve_dtype(cfg.dtype, device), device=device)
    if cfg.kv_hbm_gib is not None:
        hbm = int(cfg.kv_hbm_gib * 2**30)
    elif device == "cuda":
        hbm = int(torch.cuda.mem_get_info()[0] * AUTO_HBM_SHARE)
    else:
        hbm = int(AUTO_CPU_GIB * 2**30)
    store = KVStore(hbm_bytes=hbm, dram_bytes=int(cfg.kv_dram_gib * 2**30))
    return SiftEngine(model, tokenizer, index, kv_store=store), tokenizer, name


def make_worker(cfg: ServeConfig, replica: str = "0"):
    """-> (EngineWorker, tokenizer, served model name): one engine replica, its loop thread started."""
    from .worker import EngineWorker

    engine, tokenizer, name = make_engine(cfg)
    return EngineWorker(engine, mode=cfg.mode, max_queue=cfg.max_queue, replica=replica), tokenizer, name
