"""What every benchmark shares: the command-line flags for the result file, the run's provenance, timing, the
correctness gates, and writing the one JSON result of a benchmark.

Each script is run from the repository root with the package installed (`pip install -e .` or `make install`):

    python bench/bench_attention.py --help

and writes `bench/results/<name>.json` (or `--out DIR/<name>.json`), the figures the docs quote; earlier results
live in git history. Every result records where it comes from (`provenance`): the script and its arguments, the
commit and whether tracked files differed from it, the date, the device and the software versions. On a copy of
the tree (a GPU host the tree was copied to, with no git folder or a stale one), set `SIFT_COMMIT` to the
commit the copy was made from (and `SIFT_DIRTY=1` if the copy carried uncommitted changes): it wins over git.

Correctness gates (`Checks`): a script checks what it runs against a reference before it times anything, records
every check in its result, and exits with status 1 after writing the result when a check failed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parent.parent
# The fields every result JSON carries (tests/test_results.py holds the committed results to them).
PROVENANCE_FIELDS = ("script", "args", "commit", "dirty", "date", "device", "versions")


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


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def commit() -> tuple[str, bool | None]:
    """(HEAD's commit, whether tracked files differ from it) of the tree the script runs from; from $SIFT_COMMIT
    and $SIFT_DIRTY where the tree has no git; ("unknown", None) where neither says."""
    if os.environ.get("SIFT_COMMIT"):   # a copy of the tree: its own git folder, if any, may be of another commit
        dirty = os.environ.get("SIFT_DIRTY")
        return os.environ["SIFT_COMMIT"], None if dirty is None else dirty not in ("", "0")
    head = _git("rev-parse", "HEAD")
    if head:
        return head, bool(_git("status", "--porcelain", "--untracked-files=no"))
    return "unknown", None


def device() -> dict:
    """The device of the run: name and, for a GPU, its compute capability ("9.0")."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return dict(name=torch.cuda.get_device_name(), capability=f"{major}.{minor}")
    return dict(name=f"CPU ({platform.machine()}, {os.cpu_count()} cores)", capability=None)


def versions() -> dict:
    """Python, torch, triton, transformers and the CUDA torch was built with (None on a CPU build)."""
    import importlib.metadata as metadata

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return dict(python=platform.python_version(), torch=torch.__version__, triton=version("triton"),
                transformers=version("transformers"), cuda=torch.version.cuda)


def provenance(argv: list[str] | None = None) -> dict:
    """Where a result comes from: script (its path from the repository root), args (its argv), commit, dirty,
    date (UTC), device, versions."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0] if argv else "?").resolve()
    name = script.relative_to(ROOT).as_posix() if script.is_relative_to(ROOT) else script.name
    head, dirty = commit()
    return dict(script=name, args=argv[1:], commit=head, dirty=dirty,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=device(), versions=versions())


def environment() -> dict:
    """This run's provenance (the evaluation scripts store it with each entry of their accumulating results)."""
    return provenance()


def write_result(name: str, result: dict, out: Path = RESULTS) -> Path:
    """Write `{provenance, **result}` as out/<name>.json (replacing the previous one) and return its path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({**provenance(), **result}, indent=1, default=str) + "\n")
    print(f"wrote {path}", flush=True)
    return path


# ------------------------------------------------------------------------------------------ correctness gates

# Unit roundoff u of each dtype: rounding to nearest moves a value by at most u of itself.
UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11,
                 torch.bfloat16: 2.0**-8}
# Independent roundings of relative size at most u add in quadrature: after `depth` of them an output's relative
# error has an RMS of at most u * sqrt(depth / 3). The bound below is C_ROUNDING * u * sqrt(depth), about seven
# times that: a correct kernel stays well inside it, while a dropped block, a wrong mask or a wrong rotation errs
# by 1e-1 or more in the group of outputs it touches.
C_ROUNDING = 4.0


def tolerance(dtype: torch.dtype, depth: int, c: float = C_ROUNDING) -> float:
    """The largest relative error a correct computation may show against its reference: c * u(dtype) * sqrt(depth).
    depth: the number of roundings to `dtype` that each output element goes through and the reference's does not
    (the fp32 accumulations of matrix products add fp32 roundings only, negligible beside fp16 / bf16 ones)."""
    return c * UNIT_ROUNDOFF[dtype] * math.sqrt(depth)


def relative_error(out: torch.Tensor, ref: torch.Tensor, group_dims: int = 0) -> float:
    """||out - ref|| / ||ref|| (Frobenius, in fp64), the largest over the groups that the first `group_dims`
    dimensions index (0: the whole tensor). A group whose reference is all zero must be exactly zero; a
    non-finite output is an infinite error."""
    if out.shape != ref.shape:
        raise ValueError(f"out {tuple(out.shape)} and ref {tuple(ref.shape)} differ in shape")
    out, ref = out.double(), ref.double()
    if not bool(out.isfinite().all()):
        return math.inf
    n = math.prod(out.shape[:group_dims])
    diff = (out - ref).reshape(n, -1).norm(dim=1)
    scale = ref.reshape(n, -1).norm(dim=1)
    rel = torch.where(scale > 0, diff / scale.clamp_min(1e-300), torch.where(diff > 0, math.inf, 0.0))
    return float(rel.max()) if n else 0.0


@dataclass(frozen=True)
class Check:
    """One correctness check: ok, the measured value (an error, a count) and the bound it was held to."""

    name: str
    ok: bool
    value: float | None = None
    bound: float | None = None
    detail: str = ""


def check_close(name: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, depth: int, *,
                group_dims: int = 0, c: float = C_ROUNDING) -> Check:
    """out against ref: relative error (`relative_error`, per group) within `tolerance(dtype, depth, c)`."""
    err, bound = relative_error(out, ref, group_dims), tolerance(dtype, depth, c)
    return Check(name, err <= bound, err, bound,
                 f"relative error{' per group' if group_dims else ''}, {str(dtype).removeprefix('torch.')} "
                 f"depth {depth}")


def check_within_twin(name: str, out: torch.Tensor, twin: torch.Tensor, ref: torch.Tensor, *, factor: float,
                      ref_dtype: torch.dtype, depth: int) -> Check:
    """A whole computation (a model's logits) against a higher-precision reference `ref`: out's relative error
    within `factor` times that of `twin`, the same computation through the kernels' ref twins at out's dtype.
    Both share the rounding of the low-precision model; what the kernels add must be of the same order. The
    twin's error is floored at the reference's own precision (`tolerance(ref_dtype, depth)`), so that a
    reference as precise as the twin (fp32 on CPU) does not ask for an error below rounding."""
    err, twin_err = relative_error(out, ref), relative_error(twin, ref)
    bound = factor * max(twin_err, tolerance(ref_dtype, depth))
    return Check(name, err <= bound, err, bound, f"relative error; the twin's {twin_err:.3g} x {factor:g}")


class Checks:
    """The correctness checks of one run: each prints one line and is kept for the result JSON
    (`to_json`); `exit_status()` is 1 when any failed."""

    def __init__(self) -> None:
        self.results: list[Check] = []

    def add(self, check: Check) -> bool:
        self.results.append(check)
        value = "" if check.value is None else f" {check.value:.3g}"
        bound = "" if check.bound is None else f" (bound {check.bound:.3g})"
        print(f"check {check.name}:{value}{bound} {check.detail} {'OK' if check.ok else 'FAIL'}", flush=True)
        return check.ok

    def close(self, name: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, depth: int, *,
              group_dims: int = 0) -> bool:
        return self.add(check_close(name, out, ref, dtype, depth, group_dims=group_dims))

    def within_twin(self, name: str, out, twin, ref, *, factor: float, ref_dtype: torch.dtype, depth: int) -> bool:
        return self.add(check_within_twin(name, out, twin, ref, factor=factor, ref_dtype=ref_dtype, depth=depth))

    def equal(self, name: str, a, b, detail: str = "exact") -> bool:
        same = bool(torch.equal(a, b)) if isinstance(a, torch.Tensor) else a == b
        return self.add(Check(name, same, detail=detail))

    def at_most(self, name: str, value: float, bound: float, detail: str = "") -> bool:
        return self.add(Check(name, value <= bound, float(value), float(bound), detail))

    def true(self, name: str, ok: bool, detail: str = "") -> bool:
        return self.add(Check(name, bool(ok), detail=detail))

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.results)

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.results if not c.ok]

    def to_json(self) -> list[dict]:
        return [asdict(c) for c in self.results]

    def exit_status(self) -> int:
        """Print the verdict; 0 when every check passed, else 1."""
        if self.ok:
            print(f"all {len(self.results)} checks passed", flush=True)
            return 0
        print(f"FAILED checks: {', '.join(self.failed)}", file=sys.stderr, flush=True)
        return 1


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
    from sift.errors import SiftError

    try:
        main()
    except SiftError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
