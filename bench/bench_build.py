"""Builder throughput: the Ray job over the embedded sample corpus with the real SmolLM2 weights, next to a plain
forward pass of the same documents through the same model on the same device, in one run.

On the GPU machine (see bench/device_env.sh):  python3 bench/bench_build.py --cpu-index .dev3/cpu-index
Locally (CPU):                                 .venv/bin/python bench/bench_build.py --device cpu
Writes JSON to $OUT/build.json (or --json) and prints a table last. With --cpu-index it also counts the bits that
differ between this build and an index built by the CPU backend (same model, same documents).
"""
import argparse
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from sift.format import IndexReader
from sift.model import DEFAULT_MODEL, load_model
from sift.pipeline import SAMPLE_CORPUS, load_config, run_build
from sift.pipeline.corpus import list_sources, read_source
from sift.pipeline.profiler import profiling_prefix_ids


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

    from sift.model import resolve_model_dir

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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default=str(SAMPLE_CORPUS))
    ap.add_argument("--out", default="/tmp/sift-bench-index")
    ap.add_argument("--config", default=None)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cpu-index", default=None, help="an index of the same corpus built by the CPU backend")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "build.json"))
    args = ap.parse_args()

    cfg = load_config(args.config)
    if args.backend != "auto":
        cfg = type(cfg)(model=cfg.model, profile=cfg.profile, corpus=cfg.corpus,
                        build=type(cfg.build)(shard_rows=cfg.build.shard_rows, backend=args.backend))
    shutil.rmtree(args.out, ignore_errors=True)
    t0 = time.perf_counter()
    stats = run_build(args.corpus, args.out, cfg)
    wall = time.perf_counter() - t0
    docs = corpus_token_ids(cfg, args.corpus)
    fwd = plain_forward(cfg, args.device, docs)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({os.cpu_count()} cores)",
        "model": cfg.model, "dtype": cfg.profile.dtype, "tile": cfg.profile.tile,
        "build": {**stats.to_dict(), "wall_seconds": wall,
                  "docs_per_s_wall": stats.profiled / wall,
                  "docs_per_s_actor": stats.profiled / stats.actor_seconds if stats.actor_seconds else None,
                  "tokens_per_s_actor": stats.tokens_profiled / stats.actor_seconds if stats.actor_seconds else None},
        "plain_forward": fwd,
    }
    if args.cpu_index:
        result["flips_vs_cpu_index"] = bit_flips(Path(args.out), Path(args.cpu_index))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    b = result["build"]
    print(f"\n{result['device']}  {cfg.model} {cfg.profile.dtype} tile {cfg.profile.tile}  backend(s) {stats.backends}")
    print(f"{'':28s}{'docs':>7s}{'tokens':>9s}{'seconds':>9s}{'docs/s':>9s}{'tokens/s':>10s}")
    print(f"{'sift-build (end to end)':28s}{stats.profiled:7d}{stats.tokens_profiled:9d}{wall:9.1f}"
          f"{b['docs_per_s_wall']:9.1f}{stats.tokens_profiled / wall:10.0f}")
    if stats.actor_seconds:
        print(f"{'sift-build (actor compute)':28s}{stats.profiled:7d}{stats.tokens_profiled:9d}"
              f"{stats.actor_seconds:9.1f}{b['docs_per_s_actor']:9.1f}{b['tokens_per_s_actor']:10.0f}")
    print(f"{'plain forward, same docs':28s}{fwd['documents']:7d}{fwd['tokens']:9d}{fwd['seconds']:9.1f}"
          f"{fwd['docs_per_s']:9.1f}{fwd['tokens_per_s']:10.0f}")
    if "flips_vs_cpu_index" in result:
        print("flips vs CPU index:", json.dumps(result["flips_vs_cpu_index"]))


if __name__ == "__main__":
    main()
