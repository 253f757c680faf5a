"""Model load: `sift.model.load_model` (weights read onto the device with positional reads, `read_weights`) against
transformers' own `from_pretrained(..., device_map=device)`, on the random 8B-shaped model `bench_build.py` builds
-> bench/results/load.json (GPU) or load-cpu.json.

    python bench/bench_load.py                # H200: 8B shape, bf16, 16 GB of safetensors
    python bench/bench_load.py --smoke        # CPU: the 2-layer model (checks the script)

Gate first: every tensor `read_weights` puts on the device equals safetensors' `load_file` of the same file. Then,
the files in the page cache (just written, and read once by the gate), each loader `--repeat` times in turn: its
seconds and GB/s (the files' bytes over the seconds). `load_model` includes the tokenizer and the model's
construction around the tensors; `read_weights` is the reading alone. Prints a table last.
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from common import parser, smoke_env

smoke_env()

import torch  # noqa: E402
from common import out_dir, write_result  # noqa: E402

from sift.model import load_model, read_weights, weight_files  # noqa: E402


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def gate(files: list[Path], device: str) -> int:
    """read_weights == load_file, tensor by tensor -> the number of tensors compared."""
    from safetensors.torch import load_file

    got = read_weights(files, device)
    n = 0
    for f in files:
        for name, want in load_file(f).items():
            have = got.pop(name)
            assert have.dtype == want.dtype and have.shape == want.shape and torch.equal(have.cpu(), want), name
            n += 1
    assert not got, sorted(got)[:5]
    return n


def timed(fn, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    seconds = time.perf_counter() - t0
    del out
    if device == "cuda":
        torch.cuda.empty_cache()
    return seconds


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--work", type=Path, default=None, help="folder for the model (a temp one)")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_build import make_model
    from transformers import AutoModelForCausalLM

    device = "cpu" if args.smoke else "cuda"
    dtype = "float16" if args.smoke else "bfloat16"
    work = args.work or Path(tempfile.mkdtemp(prefix="sift-bench-load-"))
    folder, made = make_model("smoke" if args.smoke else "8b", device, work / "model")
    files = weight_files(Path(folder))
    size = sum(f.stat().st_size for f in files)
    tensors = gate(files, device)
    print(f"gate: {tensors} tensors of {len(files)} file(s), {size / 1e9:.2f} GB, equal to safetensors' load_file",
          flush=True)
    place = {} if device == "cpu" else {"device_map": device}
    loaders = {
        "transformers from_pretrained": lambda: AutoModelForCausalLM.from_pretrained(
            folder, dtype=getattr(torch, dtype), attn_implementation="sdpa", **place),
        "sift load_model": lambda: load_model(folder, dtype=dtype, device=device, identity=False),
        "sift read_weights": lambda: read_weights(files, device),
    }
    runs = {name: [] for name in loaders}
    for _ in range(args.repeat):
        for name, fn in loaders.items():
            runs[name].append(timed(fn, device))
    result = {"device": device, "dtype": dtype, "files": len(files), "bytes": size, "tensors": tensors,
              "model": made, "loaders": {name: {"seconds": min(s), "runs": s, "gb_per_s": size / 1e9 / min(s)}
                                         for name, s in runs.items()}}
    write_result("load-cpu" if device == "cpu" else "load", result, out_dir(args))
    print(f"{'loader':32s}{'best s':>8s}{'GB/s':>8s}   runs")
    for name, r in result["loaders"].items():
        print(f"{name:32s}{r['seconds']:8.2f}{r['gb_per_s']:8.2f}   {', '.join(f'{s:.2f}' for s in r['runs'])}")


if __name__ == "__main__":
    main()
