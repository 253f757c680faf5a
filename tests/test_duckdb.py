"""docs/building.md's DuckDB query, run as written over a small index, against the same ranking computed bit by
bit."""
import os
import re
from pathlib import Path

from .test_store import make_index

BUILDING = Path(__file__).resolve().parents[1] / "docs" / "building.md"
# 13 documents (more than the query's 10) of lengths whose LA vectors differ in size, so ranks differ too.
LENGTHS = {f"doc{i:02d}": n for i, n in enumerate([1, 16, 17, 33, 37, 63, 64, 65, 100, 128, 129, 200, 250])}


def doc_block(word: str) -> str:
    """docs/building.md's first ```python block that mentions `word`."""
    blocks = re.findall(r"```python\n(.*?)```", BUILDING.read_text(), flags=re.S)
    return next(b for b in blocks if word in b)


def test_building_doc_duckdb_top_documents(tmp_path):
    rows = make_index(tmp_path / "index" / "sample", LENGTHS, shards=3)
    cwd = os.getcwd()
    os.chdir(tmp_path)                      # the doc's paths are relative: index/sample
    try:
        scope = {}
        exec(doc_block("duckdb"), scope)
        top = scope["top"].fetchall()
        frame = scope["top"].df()
    finally:
        os.chdir(cwd)

    la_tiles = {doc: sum(bin(byte).count("1") for byte in r["la_bits"]) for doc, r in rows.items()}
    want = sorted(((doc, rows[doc]["n_tokens"], n) for doc, n in la_tiles.items()), key=lambda t: (-t[2], t[0]))
    assert top == want[:10]
    assert list(frame.columns) == ["doc_id", "n_tokens", "la_tiles"]
    assert frame["doc_id"].tolist() == [doc for doc, _, _ in want[:10]]
