"""What every benchmark shares: the command-line flags for the result file, the run's environment, timing,
error measures, and writing the one JSON result of a benchmark.

Each script is run from the repository root with the package installed (`pip install -e .` or `make install`):

    python bench/bench_attention.py --help

and writes `bench/results/<name>.json` (or `--out DIR/<name>.json`), the figures the README quotes; earlier
results live in git history.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def parser(description: str) -> argparse.ArgumentParser:
    """An argparse parser with the flags every benchmark takes (--out, --smoke)."""
    ap = argparse.ArgumentParser(description=description,
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON result")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on CPU (TRITON_INTERPRET=1): checks that the script runs, measures nothing")
    return ap


def smoke_env(argv: list[str] | None = None) -> bool:
    """Set TRITON_INTERPRET=1 for a --smoke run before any kernel module is imported (call it first)."""
    import sys

    smoke = "--smoke" in (argv if argv is not None else sys.argv[1:])
    if smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return smoke


def out_dir(args: argparse.Namespace) -> Path:
    """Where the result goes: --out, except that a --smoke run without its own --out writes to a temporary
    folder, so a smoke run never replaces a measured result in bench/results/."""
    if args.smoke and Path(args.out) == RESULTS:
        import tempfile

        return Path(tempfile.gettempdir()) / "sift-bench-smoke"
    return Path(args.out)


def environment() -> dict:
    """Date, device and library versions of this run."""
    import triton

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), device=device,
                torch=torch.__version__, triton=triton.__version__, python=platform.python_version())


def write_result(name: str, result: dict, out: Path = RESULTS) -> Path:
    """Write `{environment, **result}` as out/<name>.json (replacing the previous one) and return its path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({**environment(), **result}, indent=1, default=str) + "\n")
    print(f"wrote {path}", flush=True)
    return path


def gpu_ms(fn, *, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of fn() on the GPU (CUDA events around each call, L2 flushed between calls)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|, in fp32."""
    out, ref = out.float(), ref.float()
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


class IdTokenizer:
    """Stand-in tokenizer for random-weight models: text is token ids written as decimal numbers separated by
    spaces (the engine's API takes text)."""

    def __init__(self, bos: int, eos: int):
        self.bos_token_id, self.eos_token_id = bos, eos

    def __call__(self, text: str, add_special_tokens: bool = True):
        from types import SimpleNamespace

        ids = [int(t) for t in text.split()]
        return SimpleNamespace(input_ids=([self.bos_token_id] if add_special_tokens else []) + ids)

    def decode(self, ids, skip_special_tokens: bool = True, **kwargs) -> str:
        return " ".join(map(str, ids))


def run_main(main) -> None:
    """Run a benchmark's main: a SiftError (bad input, a refused setting) is one line on stderr and exit code 2."""
    import sys

    from sift.errors import SiftError

    try:
        main()
    except SiftError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
