"""Command-line entrypoints: `sift-build` and `sift-inspect`.

Exit codes (both commands):
  0  success: every document indexed (sift-inspect: the index is readable)
  1  committed, but some documents are in the errors table (sift-build only)
  2  nothing committed: bad usage, bad config, unreadable corpus, not an index, corrupt index, a folder that
     cannot be written, a full disk, or any other failure (sift-inspect: the index cannot be read, or the
     --plot folder cannot be written)

Every failure is one line on stderr; SIFT_DEBUG=1 adds the traceback of a failure that is not a SiftError.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

import click
import numpy as np
import pyarrow as pa

from sift.errors import SiftError, one_line
from sift.format import TILES, IndexReader
from sift.plots import IndexDensity, index_density, index_figures

EXIT_OK, EXIT_DOC_ERRORS, EXIT_NOTHING = 0, 1, 2


def _fail(message: str) -> None:
    click.echo(f"error: {' '.join(message.splitlines())}", err=True)
    sys.exit(EXIT_NOTHING)


def _fail_unexpected(e: Exception, consequence: str) -> None:
    """A failure the code did not name: still one line and exit 2 (the traceback only with SIFT_DEBUG=1)."""
    if os.environ.get("SIFT_DEBUG"):
        traceback.print_exc()
    _fail(f"{one_line(e)} ({consequence}; SIFT_DEBUG=1 shows the traceback)")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("corpus", type=click.Path())
@click.option("--out", required=True, type=click.Path(),
              help="Index folder or URI (s3://, gs://, hdfs://, file://), created or updated incrementally.")
@click.option("--config", "config_path", type=click.Path(), default=None,
              help="TOML config (default: configs/default.toml).")
@click.option("--model", default=None, help="'smollm2-135m-instruct' (default) or a local transformers folder.")
@click.option("--tile", type=int, default=None, help=f"Tile / page size: {', '.join(map(str, TILES))}.")
@click.option("--alpha", type=float, default=None, help="LA threshold.")
@click.option("--beta", type=float, default=None, help="CA cell threshold.")
@click.option("--gamma", type=float, default=None, help="CA concentration threshold.")
@click.option("--ray-address", default=None, help="Existing Ray cluster (default: $RAY_ADDRESS, else a local Ray).")
@click.option("-q", "--quiet", is_flag=True, help="Only the summary line.")
@click.option("-v", "--verbose", is_flag=True, help="Ray's own logs, progress and worker output too.")
def build_main(corpus, out, config_path, model, tile, alpha, beta, gamma, ray_address, quiet, verbose):
    """Profile every document of CORPUS (a folder, a file, or a URI) and write (or update) the SIFT index at
    --out. Credentials for s3:// and gs:// come from the environment, as the cloud SDKs find them.

    Progress goes to stderr: one bar in a terminal, else one line per shard written."""
    from .config import load_config
    from .job import ProgressLines, run_build

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    echo = (lambda *_: None) if quiet else (lambda msg: click.echo(msg, err=True))
    progress = _ProgressBar() if sys.stderr.isatty() and not quiet else ProgressLines(echo)
    try:
        cfg = load_config(config_path, model=model, tile=tile, alpha=alpha, beta=beta, gamma=gamma)
        stats = run_build(corpus, out, cfg, ray_address=ray_address, echo=echo, progress=progress, verbose=verbose,
                          quiet=quiet, process_started=_process_started())
    except SiftError as e:
        _fail(str(e))
    except Exception as e:  # noqa: BLE001 - exit code 1 means "committed", which this is not
        _fail_unexpected(e, "nothing was committed; the previous generation is unchanged")
    tps = stats.tokens_profiled / stats.profile_seconds if stats.profile_seconds else 0.0
    click.echo(f"committed generation {stats.generation}: {stats.documents} documents "
               f"(profiled {stats.profiled}, reused {stats.reused + stats.reused_orphans}, deleted {stats.deleted}), "
               f"{stats.errors} errors, {stats.seconds:.1f} s, {tps:.0f} tokens/s profiling"
               f"{'; ' + stats.note if stats.note else ''}")
    code = EXIT_DOC_ERRORS if stats.errors else EXIT_OK
    if not verbose:
        _leave_ray(code)
    sys.exit(code)


def _leave_ray(code: int) -> None:
    """Once the build is committed and its summary printed: when this process is the `sift-build` command and
    started its own Ray, exit now with `code` (`os._exit`, after flushing what it printed), without stopping Ray
    one process after another or tearing the interpreter down, which took 3 to 6 s after the last line. Ray's
    GCS and raylet end with this process (they are tied to it), the raylet's workers with the raylet, and the
    reaper of the local Ray instance (`ray_driver.py`) SIGKILLs whatever is left within a fraction of a second.
    Otherwise (the build called from Python, or a cluster joined) stop the local Ray, or leave the cluster, here
    rather than in Ray's exit hook, which first waits half a second for worker output that only `--verbose`
    prints."""
    from .ray_driver import started_local

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    main = getattr(sys.modules.get("__main__"), "__file__", None) or ""
    if started_local() and Path(main).name == "sift-build" and Path(sys.argv[0]).name == "sift-build":
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    ray.shutdown()


def _process_started() -> float | None:
    """When this process started (`time.time`), from its start in clock ticks since boot and the time since boot
    (Linux's /proc); None where the system does not say."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22, starttime (the name may hold spaces)
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def read_index(path: str) -> tuple[IndexReader, pa.Table, IndexDensity]:
    """The committed generation at `path`, its rows (all but `source`) and the densities of its bits."""
    reader = IndexReader.open(path)
    m = reader.manifest
    t = reader.table(["doc_id", "n_tokens", "la_bits", "ca_bits", "la_density", "ca_density"])
    return reader, t, index_density(t, tile=m.tile, n_layers=m.model.n_layers, n_heads=m.model.n_heads)


class _ProgressBar:
    """Profiling progress as one bar on a terminal: tokens (the work) with their rate and the ETA, and
    documents with theirs. The same calls as `ProgressLines`."""

    FORMAT = "{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} tokens [{elapsed}<{remaining}, {rate_fmt}{postfix}]"

    def start(self, documents: int, tokens: int) -> None:
        from tqdm import tqdm

        self.documents, self.done = documents, 0
        self.bar = tqdm(total=tokens, desc=f"profiled 0/{documents} documents", unit=" tokens", unit_scale=True,
                        bar_format=self.FORMAT, file=sys.stderr, dynamic_ncols=True)

    def total(self, documents: int, tokens: int, final: bool) -> None:
        """The documents found to profile so far (final: the corpus is read)."""
        self.documents = documents
        self.bar.total = tokens
        self.bar.set_description_str(f"profiled {self.done}/{documents} documents", refresh=False)
        self.bar.refresh()

    def shard(self, documents: int, tokens: int) -> None:
        self.done += documents
        rate = self.done / max(self.bar.format_dict["elapsed"], 1e-9)
        self.bar.set_description_str(f"profiled {self.done}/{self.documents} documents", refresh=False)
        self.bar.set_postfix_str(f"{rate:.2f} docs/s", refresh=False)
        self.bar.update(tokens)

    def close(self) -> None:
        self.bar.close()


def summarize(reader: IndexReader, t: pa.Table, d: IndexDensity) -> dict:
    """What `sift-inspect --json` prints, from what `read_index` returns."""
    m = reader.manifest
    tokens = int(np.asarray(t["n_tokens"]).sum()) if t.num_rows else 0
    la_bytes = sum(len(b) for b in t["la_bits"].to_pylist())
    ca_bytes = sum(len(b) for b in t["ca_bits"].to_pylist())
    # The KV cache the same tokens would take in bf16: K and V, every layer, every KV head.
    kv_bytes = tokens * m.model.n_layers * 2 * m.model.n_kv_heads * m.model.head_dim * 2
    la_density = np.asarray(t["la_density"].to_pylist(), dtype=np.float64) if t.num_rows else np.zeros((0, 0))
    ca_density = np.asarray(t["ca_density"].to_pylist(), dtype=np.float64) if t.num_rows else np.zeros((0, 0))
    errors = reader.errors()
    return {
        "path": reader.location.uri,
        "generation": m.generation,
        "created_at": m.created_at,
        "model": {k: getattr(m.model, k) for k in ("name", "fingerprint", "n_layers", "n_heads", "n_kv_heads",
                                                    "head_dim")},
        "profile": {k: m.profile.get(k) for k in ("tile", "alpha", "beta", "gamma", "ca_normalize", "dtype",
                                                  "ca_full_layers", "ca_full_heads")},
        "backends": m.backends,
        "documents": t.num_rows,
        "tokens": tokens,
        "shards": len(m.shards),
        "bits_bytes": la_bytes + ca_bytes,
        "la_bytes": la_bytes,
        "ca_bytes": ca_bytes,
        "kv_bytes_bf16": kv_bytes,
        "kv_over_bits": (kv_bytes / (la_bytes + ca_bytes)) if la_bytes + ca_bytes else None,
        "la_density_per_layer": la_density.mean(axis=0).round(4).tolist() if la_density.size else [],
        "ca_density_per_layer": ca_density.mean(axis=0).round(4).tolist() if ca_density.size else [],
        "tile_fraction": round(d.tile_fraction, 4),
        "page_fraction": round(d.page_fraction, 4),
        "la_density_per_head": d.la_heads.round(4).tolist(),
        "ca_density_per_head": d.ca_heads.round(4).tolist(),
        "errors": errors.num_rows,
        "error_rows": errors.slice(0, 20).to_pylist(),
        "last_build": _last_build(m.last_build),
    }


def _last_build(last: dict) -> dict:
    """The manifest's record of the build that wrote it (`BuildStats`), with the two kinds of reuse summed."""
    return {"profiled": last.get("profiled", 0), "reused": last.get("reused", 0) + last.get("reused_orphans", 0),
            "deleted": last.get("deleted", 0), "errors": last.get("errors", 0),
            "seconds": round(last.get("seconds", 0.0), 2), "tokens_profiled": last.get("tokens_profiled", 0),
            "profile_seconds": round(last.get("profile_seconds", 0.0), 2),
            "startup": {k: round(v, 2) for k, v in last.get("startup", {}).items()},
            "nodes": len(last.get("nodes", {}))}


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


def _plot_dir(path: str) -> Path:
    """The folder --plot names, created if missing; SiftError when it cannot be."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise SiftError(f"--plot {out} is a file, not a folder: give a folder for the PNGs (created if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SiftError(f"--plot {out} cannot be created ({e.strerror or e}): give a folder you can write") from None
    return out


def _figures(reader: IndexReader, d: IndexDensity, out: Path) -> list[str]:
    m = reader.manifest
    title = f"{reader.location.name}: generation {m.generation}, {m.model.name or 'model'}, tile {m.tile}"
    try:
        return [str(p) for p in index_figures(d, out, title)]
    except OSError as e:
        raise SiftError(f"cannot write the plots into {out} ({e.strerror or e}): give a folder you can write") from None


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("index", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--plot", "plot_dir", type=click.Path(), default=None,
              help="Folder (created if missing) for PNGs: LA / CA density per (layer, head), per-document "
                   "fractions, density against length.")
def inspect_main(index, as_json, plot_dir):
    """Describe the SIFT index at INDEX (a folder or a URI: s3://, gs://, hdfs://, file://)."""
    try:
        out = _plot_dir(plot_dir) if plot_dir is not None else None
        reader, table, density = read_index(index)
        s = summarize(reader, table, density)
        if out is not None:
            s["plots"] = _figures(reader, density, out)
    except SiftError as e:
        _fail(str(e))
    except Exception as e:  # noqa: BLE001 - whatever it is, the index could not be read
        _fail_unexpected(e, "the index could not be read")
    click.echo(json.dumps(s) if as_json else _describe(s))


def _describe(s: dict) -> str:
    """The text `sift-inspect` prints."""
    lb = s["last_build"]
    lines = [
        f"index       {s['path']}",
        f"generation  {s['generation']} ({s['created_at']})",
        f"model       {s['model']['name']}  fingerprint {s['model']['fingerprint'][:16]}  "
        f"{s['model']['n_layers']} layers x {s['model']['n_heads']} heads ({s['model']['n_kv_heads']} KV), "
        f"head_dim {s['model']['head_dim']}",
        f"profile     tile {s['profile']['tile']}  alpha {s['profile']['alpha']}  beta {s['profile']['beta']}  "
        f"gamma {s['profile']['gamma']}  ca_normalize {s['profile']['ca_normalize']}  dtype {s['profile']['dtype']}"
        + (f"  CA kept whole in layers {s['profile']['ca_full_layers']}" if s['profile']['ca_full_layers'] else "")
        + (f"  CA kept whole in {len(s['profile']['ca_full_heads'])} (layer, head) pairs"
           if s['profile']['ca_full_heads'] else "")
        + f"  backend(s) {', '.join(s['backends']) or '-'}",
        f"documents   {s['documents']}  ({s['tokens']} tokens, {s['shards']} shards)",
        f"bits        {_human(s['bits_bytes'])} (LA {_human(s['la_bytes'])}, CA {_human(s['ca_bytes'])})  vs  "
        f"KV cache (bf16) {_human(s['kv_bytes_bf16'])}"
        + (f"  = {s['kv_over_bits']:.0f}x smaller" if s["kv_over_bits"] else ""),
        f"kept        {s['tile_fraction']:.1%} of LA tiles (the tile fraction prefill computes), "
        f"{s['page_fraction']:.1%} of CA pages",
        f"errors      {s['errors']}",
        f"last build  profiled {lb['profiled']}, reused {lb['reused']}, deleted {lb['deleted']}, "
        f"{lb['seconds']} s" + (f" on {lb['nodes']} node(s); first shard after {lb['startup']['first_shard']} s "
                                f"(Ray {lb['startup'].get('ray', 0)} s, plan {lb['startup'].get('plan', 0)} s "
                                f"alongside; actor ready at {lb['startup'].get('actor_ready', '-')} s after a "
                                f"{lb['startup'].get('model_load', 0)} s model load)"
                                if "first_shard" in lb["startup"] else ""),
        "layer   LA density   CA density",
    ]
    for i, (la, ca) in enumerate(zip(s["la_density_per_layer"], s["ca_density_per_layer"])):
        lines.append(f"{i:5d}   {la:10.3f}   {ca:10.3f}")
    for row in s["error_rows"]:
        lines.append(f"error: {row['doc_id']} ({row['source']}): {row['reason']}")
    if "plots" in s:
        lines.append(f"plots       {', '.join(s['plots'])}")
    return "\n".join(lines)
