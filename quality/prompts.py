"""The prompts and data the research tools share with the demo: the chat template SmolLM2-Instruct answers RAG
prompts in, the HotpotQA questions shipped in quality/data, and the builder's sample corpus.

    SYSTEM, QUERY        the chat prompt: SYSTEM opens the user turn before the passages, QUERY holds the
                         question and closes the turn
    load_questions(n)    the first n HotpotQA questions of quality/data (CC BY-SA 4.0)
    hotpot_request(q)    one of them as a `Request` over its 10 paragraphs
    sample_corpus()      the folder of the sample corpus `sift-build` ships (found without importing the builder)
"""
from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from ..runtime.engine import Request

DATA = Path(__file__).resolve().parent / "data"
HOTPOTQA = DATA / "hotpotqa_train_100.jsonl.gz"
TWOWIKI = DATA / "2wikimultihopqa_dev_200.jsonl.gz"
SYSTEM = ("<|im_start|>system\nYou are a helpful assistant. Answer the question using the passages. Reply with "
          "a short answer only.<|im_end|>\n<|im_start|>user\nPassages:\n")
QUERY = "\n\nQuestion: {question}<|im_end|>\n<|im_start|>assistant\n"


def load_questions(n: int | None = None) -> list[dict]:
    """HotpotQA questions (quality/data, CC BY-SA 4.0): id, question, answer, paragraphs [[title, text]]."""
    with gzip.open(HOTPOTQA, "rt") as f:
        rows = [json.loads(line) for line in f]
    return rows if n is None else rows[:n]


def hotpot_request(q: dict, *, chat: bool = True) -> Request:
    """A question as a RAG request: doc_id = paragraph title, text exactly as indexed. chat=True wraps prefix
    and query in SmolLM2's chat template (its special tokens are plain text here; the tokenizer parses them)."""
    docs = [(title, text) for title, text in q["paragraphs"]]
    if chat:
        return Request(SYSTEM, docs, QUERY.format(question=q["question"]))
    return Request("Answer the question from the passages.\n", docs, f"\nQuestion: {q['question']}\nAnswer:")


def sample_corpus() -> Path:
    """The sample corpus shipped in the builder's package folder (found without importing the builder, and with
    it Ray)."""
    spec = importlib.util.find_spec("sift.pipeline")
    return Path(spec.submodule_search_locations[0]) / "sample_corpus"
