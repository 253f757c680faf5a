"""The reader text of the reader criterion (SPEC section 2): what the builder places after every document it
profiles with `[profile] criterion = "reader"`, and what the eval's `reader@C` reference places there too.

The default reader is the shipped sample corpus's Wikipedia leads, in file order, each after a blank line, cut at
`READER_TOKENS` tokens: general prose that reads back into the document the way a later passage or a question of a
RAG prompt does. A configured reader text is used whole. The sample corpus is found without importing the
builder (and with it Ray), so serving and eval code can read it too.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

READER_TOKENS = 1024


def default_reader_path() -> Path:
    """The shipped sample corpus's Wikipedia leads (the default reader's source)."""
    spec = importlib.util.find_spec("sift.pipeline")
    return Path(spec.submodule_search_locations[0]) / "sample_corpus" / "wiki_vital_leads.jsonl"


def reader_ids(tokenizer, text: str | None = None, *, n_tokens: int = READER_TOKENS) -> list[int]:
    """The reader's token ids (no special tokens). text None: the default reader, cut at n_tokens tokens; else
    the text's own tokens, all of them."""
    if text is not None:
        return list(tokenizer(text, add_special_tokens=False).input_ids)
    ids: list[int] = []
    with open(default_reader_path()) as f:
        for line in f:
            ids += tokenizer("\n\n" + json.loads(line)["text"], add_special_tokens=False).input_ids
            if len(ids) >= n_tokens:
                break
    return ids[:n_tokens]


def reader_digest(ids: list[int]) -> str:
    """Hex sha256 of the reader's token ids (little-endian int32), as the index records it."""
    return hashlib.sha256(b"".join(int(t).to_bytes(4, "little", signed=True) for t in ids)).hexdigest()
