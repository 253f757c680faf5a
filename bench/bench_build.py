"""Builder throughput: sift-build's Ray job next to a plain forward of the same documents -> results/build.json.

    python bench/bench_build.py [--backend auto|torch|triton] [--cpu-index INDEX] [--out DIR]
    python bench/bench_build.py --smoke      # CPU, torch backend, 4 documents: checks that the script runs

The Ray job builds an index of the sample corpus with the real SmolLM2 weights; the plain forward runs the same
documents through the same model on the same device, in the same run. Prints a table last. With --cpu-index it
also counts the bits that differ between this build and an index of the same corpus built by the CPU (torch)
backend, same model.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import RESULTS, parser, write_result

from sift.format import IndexReader
from sift.model import load_model, resolve_model_dir
from sift.pipeline import SAMPLE_CORPUS, load_config, run_build
from sift.pipeline.corpus import list_sources, read_source
from sift.pipeline.profiler import profiling_prefix_ids

SMOKE_DOCS = 4


def plain_forward(cfg, device: str, docs: list[list[int]]) -> dict:
    model, tokenizer, _ = load_model(cfg.model, dtype=cfg.profile.dtype, device=device)
    prefix = profiling_prefix_ids(tokenizer, cfg.profile)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with torch.inference_mode():
        for ids in docs[:3]:  # warm-up
            model.base_model(input_ids=torch.tensor([prefix + ids], device=device))
        sync()
        t0 = time.perf_counter()
        for ids in docs:
            model.base_model(input_ids=torch.tensor([prefix + ids], device=device))
        sync()
        seconds = time.perf_counter() - t0
    tokens = sum(len(d) for d in docs)
    return {"documents": len(docs), "tokens": tokens, "seconds": seconds, "docs_per_s": len(docs) / seconds,
            "tokens_per_s": tokens / seconds}


def corpus_token_ids(cfg, corpus) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_dir(cfg.model))
    docs = []
    for source in list_sources(corpus):
        for d in read_source(source, id_field=cfg.corpus.id_field, text_field=cfg.corpus.text_field):
            if d.error is None:
                docs.append(tok(d.text, add_special_tokens=False).input_ids)
    return docs


def bit_flips(index_a: Path, index_b: Path) -> dict:
    a = {r["doc_id"]: r for r in IndexReader.open(index_a).table().to_pylist()}
    b = {r["doc_id"]: r for r in IndexReader.open(index_b).table().to_pylist()}
    common = sorted(set(a) & set(b))
    out = {"documents_compared": len(common), "la_bits": 0, "ca_bits": 0, "la_flips": 0, "ca_flips": 0,
           "docs_identical": 0}
    for d in common:
        same = True
        for col in ("la", "ca"):
            x = np.unpackbits(np.frombuffer(a[d][f"{col}_bits"], np.uint8))
            y = np.unpackbits(np.frombuffer(b[d][f"{col}_bits"], np.uint8))
            out[f"{col}_bits"] += int(x.size)
            flips = int((x != y).sum())
            out[f"{col}_flips"] += flips
            same &= flips == 0
        out["docs_identical"] += int(same)
    return out


def smoke_corpus(folder: Path) -> Path:
    """The first SMOKE_DOCS records of the sample corpus's Wikipedia leads, as a one-file corpus."""
    lines = (SAMPLE_CORPUS / "wiki_vital_leads.jsonl").read_text(encoding="utf-8").splitlines()[:SMOKE_DOCS]
    path = folder / "smoke.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def print_table(result: dict, backends: list[str]) -> None:
    b, fwd = result["build"], result["plain_forward"]
    print(f"\n{result['device']}  {result['model']} {result['dtype']} tile {result['tile']}  backend(s) {backends}")
    print(f"{'':28s}{'docs':>7s}{'tokens':>9s}{'seconds':>9s}{'docs/s':>9s}{'tokens/s':>10s}")
    print(f"{'sift-build (end to end)':28s}{b['profiled']:7d}{b['tokens_profiled']:9d}{b['wall_seconds']:9.1f}"
          f"{b['docs_per_s_wall']:9.1f}{b['tokens_profiled'] / b['wall_seconds']:10.0f}")
    if b["actor_seconds"]:
        print(f"{'sift-build (actor compute)':28s}{b['profiled']:7d}{b['tokens_profiled']:9d}"
              f"{b['actor_seconds']:9.1f}{b['docs_per_s_actor']:9.1f}{b['tokens_per_s_actor']:10.0f}")
    print(f"{'plain forward, same docs':28s}{fwd['documents']:7d}{fwd['tokens']:9d}{fwd['seconds']:9.1f}"
          f"{fwd['docs_per_s']:9.1f}{fwd['tokens_per_s']:10.0f}")
    if "flips_vs_cpu_index" in result:
        print("flips vs CPU index:", json.dumps(result["flips_vs_cpu_index"]))


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=SAMPLE_CORPUS, help="corpus folder or file")
    ap.add_argument("--index", type=Path, default=Path(tempfile.gettempdir()) / "sift-bench-index",
                    help="index folder the build writes (deleted first)")
    ap.add_argument("--config", default=None, help="TOML config; none: configs/default.toml")
    ap.add_argument("--backend", choices=("auto", "torch", "triton"), default="auto",
                    help="build.backend for the Ray job's actors")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                    help="device of the plain forward")
    ap.add_argument("--cpu-index", type=Path, default=None,
                    help="an index of the same corpus built by the CPU backend, to count differing bits")
    args = ap.parse_args()

    cfg = load_config(args.config)
    corpus, backend, device = args.corpus, args.backend, args.device
    if args.smoke:
        corpus, backend, device = smoke_corpus(Path(tempfile.mkdtemp())), "torch", "cpu"
    if backend != "auto":
        cfg = dataclasses.replace(cfg, build=dataclasses.replace(cfg.build, backend=backend))
    shutil.rmtree(args.index, ignore_errors=True)
    t0 = time.perf_counter()
    stats = run_build(corpus, args.index, cfg)
    wall = time.perf_counter() - t0
    fwd = plain_forward(cfg, device, corpus_token_ids(cfg, corpus))
    result = {
        "smoke": args.smoke, "model": cfg.model, "dtype": cfg.profile.dtype, "tile": cfg.profile.tile,
        "build": {**stats.to_dict(), "wall_seconds": wall,
                  "docs_per_s_wall": stats.profiled / wall,
                  "docs_per_s_actor": stats.profiled / stats.actor_seconds if stats.actor_seconds else None,
                  "tokens_per_s_actor": stats.tokens_profiled / stats.actor_seconds if stats.actor_seconds else None},
        "plain_forward": fwd,
    }
    if args.cpu_index:
        result["flips_vs_cpu_index"] = bit_flips(args.index, args.cpu_index)
    # A smoke run never replaces the measured result: it goes to results/smoke/ unless --out says otherwise.
    path = write_result("build", result, args.out / "smoke" if args.smoke and args.out == RESULTS else args.out)
    print_table(json.loads(path.read_text()), stats.backends)


if __name__ == "__main__":
    main()
