"""The QA sets the answer benchmarks run (eval_reuse.py, eval_quality.py), and an index built in this process.

    hotpotqa   quality/data/hotpotqa_train_100.jsonl.gz: each question over its 10 paragraphs (~130 tokens each)
    2wiki      quality/data/2wikimultihopqa_dev_200.jsonl.gz: 2WikiMultihopQA dev questions (compositional,
               comparison, bridge-comparison, inference) over their 10 paragraphs (~90 tokens each)
    long       the long-document set of quality/qa.py (`long_documents`): each question's two gold paragraphs
               and first distractor, each embedded in ~1-1.5K tokens of Wikipedia leads on one topic
               (../shared/data/hotpotqa_train.json and wiki_vital_summaries_en.json.gz)
    nq-long    quality/qa.py's `nq_long_documents`: NaturalQuestions-open questions (single hop), each over its
               gold passage and two other questions' passages, each embedded like `long`'s paragraphs
               (../shared/data/nq-open-oracle.jsonl.gz): a second long-document set, of other questions

`build_in_process` writes the index `sift-build` would write for the same documents and profile settings, with
the builder's Profiler, shard writer and manifest commit in this process and no Ray: for a GPU machine that has
the model folder but not the builder's cluster stack, and for sweeps that build many small indexes, where
starting Ray per build would cost more than the profiling.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

from sift.quality.prompts import HOTPOTQA, TWOWIKI
from sift.quality.qa import QAItem, load_qa, long_documents, nq_long_documents

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
SETS = ("hotpotqa", "2wiki", "long", "nq-long")


def load_set(name: str, limit: int, *, hotpotqa_json: Path = SHARED / "hotpotqa_train.json",
             wiki: Path = SHARED / "wiki_vital_summaries_en.json.gz", doc_chars: int = 5400,
             nq_json: Path = SHARED / "nq-open-oracle.jsonl.gz") -> list[QAItem]:
    """The first `limit` questions of one of SETS."""
    if name == "hotpotqa":
        return load_qa(HOTPOTQA, "hotpotqa", limit)[0]
    if name == "2wiki":
        return load_qa(TWOWIKI, "jsonl", limit)[0]
    if name == "long":
        return long_documents(hotpotqa_json, wiki, limit=limit, doc_chars=doc_chars)
    if name == "nq-long":
        return nq_long_documents(nq_json, wiki, limit=limit, doc_chars=doc_chars)
    raise ValueError(f"QA set {name!r} is not one of {', '.join(SETS)}")


def corpus_docs(corpus: Path) -> dict[str, str]:
    """doc_id -> text of a corpus folder written by `quality.qa.write_corpus` (docs.jsonl of {"id", "text"})."""
    docs = {}
    with open(corpus / "docs.jsonl") as f:
        for line in f:
            row = json.loads(line)
            docs.setdefault(row["id"], row["text"])
    return docs


def build_in_process(docs: dict[str, str], root: Path, cfg, model, tokenizer, model_dir: Path,
                     profile_key: str = "in-process", sensitivity: bool = False) -> Path:
    """Index `docs` (doc_id -> text) at `root` (replaced if it exists) with the ProfileConfig `cfg`, profiling on
    `model`'s device in its dtype. sensitivity: also write each document's `context_sensitivity` (the optional
    column of SPEC section 3, pipeline/sensitivity.py; mode "auto" reads it). -> root."""
    import pyarrow as pa

    from sift import format as fmt
    from sift.format import content_hash
    from sift.model import fingerprint
    from sift.pipeline import index as idx
    from sift.pipeline.profiler import Profiler
    from sift.pipeline.sensitivity import context_sensitivity, default_context_ids

    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    cfg = dataclasses.replace(cfg, dtype=dtype)
    backend = "triton" if next(model.parameters()).is_cuda else "torch"
    previous = model.config._attn_implementation
    profiler = Profiler(model, tokenizer, cfg, backend)
    context = default_context_ids(tokenizer)
    rows, t = [], time.perf_counter()
    try:
        for doc_id, text in docs.items():
            ids = list(tokenizer(text, add_special_tokens=False).input_ids)
            b = profiler.profile(ids)
            rows.append(dict(doc_id=doc_id, content_hash=content_hash(ids), n_tokens=len(ids), la_bits=b.la,
                             ca_bits=b.ca, source=profile_key, la_density=b.la_density, ca_density=b.ca_density))
    finally:
        model.set_attn_implementation(previous)
    print(f"  profiled {len(rows)} documents in {time.perf_counter() - t:.1f} s", flush=True)
    if sensitivity:     # with the model's own attention again
        t = time.perf_counter()
        for row, text in zip(rows, docs.values()):
            ids = list(tokenizer(text, add_special_tokens=False).input_ids)
            row["context_sensitivity"] = context_sensitivity(model, profiler.prefix_ids, ids, context)
        print(f"  context sensitivity of {len(rows)} documents in {time.perf_counter() - t:.1f} s", flush=True)
    shutil.rmtree(root, ignore_errors=True)
    idx.prepare_dir(root)
    schema = fmt.DOCS_SCHEMA.append(pa.field("context_sensitivity", pa.float32())) if sensitivity else fmt.DOCS_SCHEMA
    info = idx.write_table(root, pa.Table.from_pylist(rows, schema=schema), kind="part",
                           profile_key=profile_key, backend=profiler.backend_label)
    c = model.config
    profile = dataclasses.asdict(cfg)
    profile["dense_heads"] = [list(h) for h in cfg.dense_heads]
    idx.commit_manifest(root, fmt.Manifest.from_dict({
        "format": fmt.FORMAT, "format_version": fmt.FORMAT_VERSION, "generation": 1, "created_at": idx.now_iso(),
        "model": {"name": str(model_dir), "fingerprint": fingerprint(model_dir), "model_type": c.model_type,
                  **dataclasses.asdict(fmt.ModelGeometry.from_config(c)), "rope": {},
                  "max_position_embeddings": c.max_position_embeddings},
        "profile": {**profile, "prefix_token_ids": list(profiler.prefix_ids), "profile_key": profile_key},
        "shards": [info.to_dict()], "errors": None, "documents": len(rows)}))
    return root
