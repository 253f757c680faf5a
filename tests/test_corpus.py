"""Corpus readers: every format, every kind of bad input, the duplicate policy, and the shipped sample corpus."""
from __future__ import annotations

import gzip
import json
import logging
import pickle
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sift.errors import SiftError
from sift.pipeline import corpus
from sift.pipeline.corpus import SAMPLE_CORPUS, Source, SourceDoc, list_sources, read_source, resolve_duplicates


def read_all(root, **kwargs) -> list[SourceDoc]:
    return [doc for source in list_sources(root) for doc in read_source(source, **kwargs)]


def by_source(docs: list[SourceDoc]) -> dict[str, SourceDoc]:
    return {d.source: d for d in docs}


def write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data, encoding="utf-8")
    return path


def jsonl(*records) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


# ------------------------------------------------------------------------------------------------ folders of files


def test_folder_of_text_files_uses_posix_relative_paths_as_ids(tmp_path):
    write(tmp_path / "b.txt", "second")
    write(tmp_path / "a.md", "# first\n")
    write(tmp_path / "sub" / "dir" / "c.md", "nested")
    sources = list_sources(tmp_path)
    assert [s.path for s in sources] == ["a.md", "b.txt", "sub/dir/c.md"]
    assert {s.kind for s in sources} == {"text"}
    docs = read_all(tmp_path)
    assert [(d.doc_id, d.text, d.source, d.error) for d in docs] == [
        ("a.md", "# first\n", "a.md", None),
        ("b.txt", "second", "b.txt", None),
        ("sub/dir/c.md", "nested", "sub/dir/c.md", None),
    ]


def test_hidden_and_other_files_are_ignored_and_logged(tmp_path, caplog):
    write(tmp_path / "keep.txt", "kept")
    write(tmp_path / ".hidden.txt", "hidden file")
    write(tmp_path / ".git" / "x.md", "hidden folder")
    write(tmp_path / "image.png", b"\x89PNG")
    write(tmp_path / "sub" / "script.py", "print(1)")
    with caplog.at_level(logging.DEBUG, logger=corpus.__name__):
        sources = list_sources(tmp_path)
    assert [s.path for s in sources] == ["keep.txt"]
    ignored = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any("image.png" in m and "sub/script.py" in m for m in ignored)
    assert not any(".hidden" in m or ".git" in m for m in ignored)


def test_text_file_encoding_problems_become_error_rows(tmp_path):
    write(tmp_path / "latin1.txt", "caf\xe9".encode("latin-1"))
    write(tmp_path / "nul.txt", b"abc\x00def")
    write(tmp_path / "empty.md", "")
    write(tmp_path / "blank.md", " \n\t\n")
    write(tmp_path / "bom.txt", b"\xef\xbb\xbfhello")
    docs = by_source(read_all(tmp_path))
    assert docs["latin1.txt"].error.startswith("not valid UTF-8")
    assert "re-encode" in docs["latin1.txt"].error
    assert docs["nul.txt"].error.startswith("binary file")
    assert docs["empty.md"].error.startswith("empty document")
    assert docs["blank.md"].error.startswith("empty document")
    assert docs["bom.txt"] == SourceDoc("bom.txt", "hello", "bom.txt", None)
    for name in ("latin1.txt", "nul.txt"):
        assert docs[name].text is None and docs[name].doc_id == name
    for doc in docs.values():
        assert doc.error is None or "\n" not in doc.error


def test_unreadable_file_is_an_error_row(tmp_path):
    write(tmp_path / "a.txt", "x")
    missing = Source("text", str(tmp_path), "gone.txt")
    [doc] = read_source(missing)
    assert doc.doc_id == "gone.txt" and doc.text is None and doc.error.startswith("cannot read file")


def test_symlinks_inside_are_read_outside_are_error_rows_unless_followed(tmp_path):
    corpus_dir, outside = tmp_path / "corpus", tmp_path / "outside"
    write(corpus_dir / "real.txt", "inside the corpus")
    write(outside / "secret.txt", "outside the corpus")
    write(outside / "data.jsonl", jsonl({"id": "r1", "text": "a record outside"}))
    (corpus_dir / "alias.txt").symlink_to(corpus_dir / "real.txt")
    (corpus_dir / "escape.txt").symlink_to(outside / "secret.txt")
    (corpus_dir / "escape.jsonl").symlink_to(outside / "data.jsonl")
    docs = by_source(read_all(corpus_dir))
    assert docs["alias.txt"].text == "inside the corpus" and docs["alias.txt"].error is None
    for name in ("escape.txt", "escape.jsonl"):
        assert docs[name].text is None and "outside the corpus folder" in docs[name].error
        assert "corpus.follow_symlinks = true" in docs[name].error
    followed = by_source(read_all(corpus_dir, follow_symlinks=True))
    assert followed["escape.txt"].text == "outside the corpus"
    assert followed["escape.jsonl#1"].doc_id == "r1"


def test_dangling_symlinks_and_loops_are_error_rows_with_the_right_hint(tmp_path):
    write(tmp_path / "ok.txt", "fine")
    (tmp_path / "dangling.txt").symlink_to(tmp_path / "deleted.txt")
    (tmp_path / "loop.txt").symlink_to(tmp_path / "loop.txt")
    (tmp_path / "a.md").symlink_to(tmp_path / "b.md")
    (tmp_path / "b.md").symlink_to(tmp_path / "a.md")
    docs = by_source(read_all(tmp_path))
    assert docs["ok.txt"].error is None
    assert docs["dangling.txt"].error.startswith("broken symlink") and "deleted.txt" in docs["dangling.txt"].error
    for name in ("loop.txt", "a.md", "b.md"):
        assert docs[name].error.startswith("symlink loop"), docs[name].error
    assert not any("permissions" in d.error for d in docs.values() if d.error)


def test_max_chars_turns_long_documents_into_error_rows(tmp_path):
    write(tmp_path / "long.txt", "x" * 11)
    write(tmp_path / "short.txt", "x" * 10)
    docs = by_source(read_all(tmp_path, max_chars=10))
    assert docs["short.txt"].error is None
    assert "max_chars=10" in docs["long.txt"].error and docs["long.txt"].text == "x" * 11


# ----------------------------------------------------------------------------------------------------------- jsonl


def test_jsonl_records_ids_and_line_numbers(tmp_path):
    write(tmp_path / "d.jsonl", jsonl({"id": "alpha", "text": "A"}, "", {"id": 7, "text": "B", "extra": [1]}))
    docs = read_all(tmp_path)
    assert docs == [SourceDoc("alpha", "A", "d.jsonl#1", None), SourceDoc("7", "B", "d.jsonl#3", None)]


def test_jsonl_gz_and_custom_field_names(tmp_path):
    write(tmp_path / "d.jsonl.gz", gzip.compress(jsonl({"key": 1, "body": "gz text"}).encode()))
    [source] = list_sources(tmp_path)
    assert source.kind == "jsonl"
    assert read_source(source, id_field="key", text_field="body") == [SourceDoc("1", "gz text", "d.jsonl.gz#1", None)]


def test_jsonl_bad_lines_become_error_rows(tmp_path):
    write(tmp_path / "d.jsonl", jsonl(
        {"id": "ok", "text": "fine"},          # 1
        '{"id": "broken", "text": ',           # 2 not JSON
        {"text": "no id"},                     # 3
        {"id": "no-text"},                     # 4
        {"id": "null-text", "text": None},     # 5
        {"id": "blank", "text": "  \n "},      # 6
        [1, 2],                                # 7 not an object
        {"id": True, "text": "bool id"},       # 8
        {"id": 1.5, "text": "float id"},       # 9
        {"id": "", "text": "empty id"},        # 10
        {"id": "num-text", "text": 3},         # 11
        {"id": None, "text": "null id"},       # 12
    ).encode() + b'{"id": "bad-utf8", "text": "caf\xe9"}\n')  # 13: a latin-1 byte
    docs = by_source(read_all(tmp_path))
    assert docs["d.jsonl#1"] == SourceDoc("ok", "fine", "d.jsonl#1", None)
    expected = {
        2: "line is not valid JSON",
        3: "record has no 'id' field",
        4: "record has no 'text' field",
        5: "'text' is null",
        6: "empty document",
        7: "line is a JSON list",
        8: "'id' has type bool",
        9: "'id' has type float",
        10: "'id' is empty",
        11: "'text' has type int",
        12: "'id' is null",
        13: "line is not valid UTF-8",
    }
    for line, prefix in expected.items():
        doc = docs[f"d.jsonl#{line}"]
        assert doc.error is not None and doc.error.startswith(prefix), (line, doc.error)
        assert "; " in doc.error and "\n" not in doc.error  # names the problem, then the fix
    # rows whose id could be read keep it; rows without a usable id are named by their location
    assert docs["d.jsonl#4"].doc_id == "no-text" and docs["d.jsonl#3"].doc_id == "d.jsonl#3"
    assert docs["d.jsonl#6"].text == "  \n " and docs["d.jsonl#5"].text is None


def test_corrupt_gzip_is_one_error_row(tmp_path):
    write(tmp_path / "d.jsonl.gz", gzip.compress(jsonl({"id": 1, "text": "x"}).encode())[:-6])
    [doc] = read_all(tmp_path)
    assert doc.doc_id == "d.jsonl.gz" and doc.text is None and doc.error.startswith("cannot read file")


# --------------------------------------------------------------------------------------------------------- parquet


def test_parquet_records_rows_are_zero_based(tmp_path):
    pq.write_table(pa.table({"id": [10, 11], "text": ["ten", None], "other": [1.0, 2.0]}), tmp_path / "p.parquet")
    docs = read_all(tmp_path)
    assert docs[0] == SourceDoc("10", "ten", "p.parquet#0", None)
    assert docs[1].doc_id == "11" and docs[1].text is None and docs[1].error.startswith("'text' is null")


def test_corrupt_parquet_is_one_error_row_for_the_file(tmp_path):
    write(tmp_path / "sub" / "bad.parquet", b"PAR1 this is not a parquet file PAR1")
    [doc] = read_all(tmp_path)
    assert doc.doc_id == "sub/bad.parquet" and doc.source == "sub/bad.parquet" and doc.text is None
    assert doc.error.startswith("corrupt or unreadable parquet file") and "\n" not in doc.error


def test_parquet_missing_column_is_one_error_row(tmp_path):
    pq.write_table(pa.table({"id": ["a", "b"], "body": ["x", "y"]}), tmp_path / "p.parquet")
    [doc] = read_all(tmp_path)
    assert doc.doc_id == "p.parquet" and doc.error.startswith("no 'text' column (columns: id, body)")
    assert [d.text for d in read_all(tmp_path, text_field="body")] == ["x", "y"]


def test_big_parquet_files_are_cut_at_row_groups(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "ROWS_PER_SOURCE", 4)
    n = 11
    pq.write_table(pa.table({"id": list(range(n)), "text": [f"t{i}" for i in range(n)]}), tmp_path / "p.parquet",
                   row_group_size=3)
    sources = list_sources(tmp_path)
    assert [(s.start, s.stop) for s in sources] == [(0, 6), (6, 11)]
    docs = [d for s in sources for d in read_source(s)]
    assert [d.doc_id for d in docs] == [str(i) for i in range(n)]
    assert [d.source for d in docs] == [f"p.parquet#{i}" for i in range(n)]


# ---------------------------------------------------------------------------------------------- saved datasets


@pytest.fixture(scope="module")
def datasets_quiet():
    import datasets

    datasets.disable_progress_bars()
    return datasets


def test_saved_dataset_in_a_subfolder(tmp_path, datasets_quiet):
    datasets_quiet.Dataset.from_dict({"id": [1, 2], "text": ["one", "two"]}).save_to_disk(tmp_path / "hf" / "ds")
    write(tmp_path / "a.txt", "file")
    sources = list_sources(tmp_path)
    assert [(s.kind, s.path, s.split) for s in sources] == [("text", "a.txt", None), ("dataset", "hf/ds", None)]
    docs = read_all(tmp_path)
    assert docs[1:] == [SourceDoc("1", "one", "hf/ds#0", None), SourceDoc("2", "two", "hf/ds#1", None)]


def test_saved_dataset_dict_splits_are_sources(tmp_path, datasets_quiet):
    dd = datasets_quiet.DatasetDict({
        "train": datasets_quiet.Dataset.from_dict({"doc": ["a", "b"], "body": ["A", ""]}),
        "test": datasets_quiet.Dataset.from_dict({"doc": ["c"], "body": ["C"]}),
    })
    dd.save_to_disk(tmp_path / "qa")
    sources = list_sources(tmp_path / "qa")  # the dataset folder itself as the corpus
    assert [(s.path, s.split) for s in sources] == [("qa", "test"), ("qa", "train")]
    docs = read_all(tmp_path / "qa", id_field="doc", text_field="body")
    assert [(d.doc_id, d.source, d.error is None) for d in docs] == [
        ("c", "qa:test#0", True), ("a", "qa:train#0", True), ("b", "qa:train#1", False)]
    assert docs[2].error.startswith("empty document")
    [missing] = read_source(sources[0])  # default field names do not exist in this dataset
    assert missing.doc_id == "qa:test" and missing.error.startswith("no 'id' column")
    pickle.loads(pickle.dumps(sources))  # Ray ships sources to workers


def test_big_dataset_splits_are_cut_into_row_ranges(tmp_path, datasets_quiet, monkeypatch):
    monkeypatch.setattr(corpus, "ROWS_PER_SOURCE", 4)
    datasets_quiet.Dataset.from_dict({"id": list(range(9)), "text": ["t"] * 9}).save_to_disk(tmp_path / "ds")
    sources = list_sources(tmp_path)
    assert [(s.start, s.stop) for s in sources] == [(0, 4), (4, 8), (8, 9)]
    assert [d.source for s in sources for d in read_source(s)] == [f"ds#{i}" for i in range(9)]


def test_broken_saved_dataset_is_an_error_row(tmp_path):
    write(tmp_path / "ds" / "state.json", "{not json")
    write(tmp_path / "ds" / "dataset_info.json", "{}")
    [doc] = read_all(tmp_path)
    assert doc.doc_id == "ds" and doc.text is None and doc.error.startswith("cannot load saved dataset")


# ------------------------------------------------------------------------------------------ single files, listing


def test_single_file_as_corpus(tmp_path):
    write(tmp_path / "one.md", "solo")
    write(tmp_path / "d.jsonl", jsonl({"id": "x", "text": "y"}))
    assert read_all(tmp_path / "one.md") == [SourceDoc("one.md", "solo", "one.md", None)]
    assert read_all(tmp_path / "d.jsonl") == [SourceDoc("x", "y", "d.jsonl#1", None)]


@pytest.mark.parametrize("case", ["missing", "empty", "only-ignored", "unsupported-file", "unreadable"])
def test_list_sources_refuses_what_it_cannot_read(tmp_path, monkeypatch, case):
    root = tmp_path / "corpus"
    if case != "missing":
        root.mkdir()
    if case == "only-ignored":
        write(root / "notes.pdf", b"%PDF")
        write(root / ".hidden.txt", "x")
    if case == "unsupported-file":
        root = write(tmp_path / "table.csv", "a,b\n")
    if case == "unreadable":
        write(root / "a.txt", "x")
        # Tests may run as root, which chmod cannot lock out: deny access the way the OS would report it.
        monkeypatch.setattr(corpus.os, "access", lambda path, mode: False)
    with pytest.raises(SiftError) as info:
        list_sources(root)
    message = str(info.value)
    assert str(root.resolve() if case != "missing" else root) in message
    assert "\n" not in message and "; " in message


def test_sources_are_sorted_and_picklable(tmp_path):
    for name in ("z.txt", "m/b.jsonl", "a.parquet", "m/a.md"):
        write(tmp_path / name, "x")
    sources = list_sources(tmp_path)
    assert [s.path for s in sources] == ["a.parquet", "m/a.md", "m/b.jsonl", "z.txt"]
    assert pickle.loads(pickle.dumps(sources)) == sources
    assert list_sources(tmp_path) == sources


# ------------------------------------------------------------------------------------------------- duplicates


def test_duplicates_within_and_across_files_first_occurrence_wins(tmp_path):
    write(tmp_path / "a.jsonl", jsonl({"id": "x", "text": "first"}, {"id": "y", "text": "Y"},
                                      {"id": "x", "text": "again in the same file"}))
    pq.write_table(pa.table({"id": ["x", "z"], "text": ["in parquet", "Z"]}), tmp_path / "b.parquet")
    write(tmp_path / "c.jsonl", jsonl({"id": "z", "text": "across files"}, {"id": 5, "text": "int id"},
                                      {"id": "5", "text": "same id as a string"}))
    docs = resolve_duplicates(read_all(tmp_path))
    kept = [(d.doc_id, d.source) for d in docs if d.error is None]
    assert kept == [("x", "a.jsonl#1"), ("y", "a.jsonl#2"), ("z", "b.parquet#1"), ("5", "c.jsonl#2")]
    errors = {d.source: d.error for d in docs if d.error is not None}
    assert errors == {
        "a.jsonl#3": "duplicate doc_id, first seen in a.jsonl#1; give each document a unique id",
        "b.parquet#0": "duplicate doc_id, first seen in a.jsonl#1; give each document a unique id",
        "c.jsonl#1": "duplicate doc_id, first seen in b.parquet#1; give each document a unique id",
        "c.jsonl#3": "duplicate doc_id, first seen in c.jsonl#2; give each document a unique id",
    }
    assert len(docs) == 8  # nothing disappears: every input row is reported, kept or as an error
    assert next(d for d in docs if d.source == "a.jsonl#3").text == "again in the same file"


def test_error_rows_claim_no_id():
    rows = [SourceDoc("x", None, "a.jsonl#1", "'text' is null; give the record a text or remove it"),
            SourceDoc("x", "ok", "a.jsonl#2", None)]
    assert resolve_duplicates(rows) == rows


# ------------------------------------------------------------------------------------------------ sample corpus


def test_sample_corpus_reads_without_errors():
    sources = list_sources(SAMPLE_CORPUS)
    docs = resolve_duplicates(d for s in sources for d in read_source(s))
    assert [d for d in docs if d.error is not None] == []
    per_file = Counter(d.source.split("#")[0] for d in docs)
    assert per_file["wiki_vital_leads.jsonl"] == 300
    assert per_file["hotpotqa_passages.jsonl"] == 200
    assert per_file["wiki_vital_topics.jsonl"] == 12
    notes = sorted(d.doc_id for d in docs if d.doc_id.startswith("notes/"))
    assert notes == ["notes/about_this_corpus.md", "notes/how_sift_works.md",
                     "notes/runtime/position_free_kv.md", "notes/tiles_and_pages.txt"]
    assert len(docs) == 516 and len({d.doc_id for d in docs}) == 516
    wiki = [json.loads(line) for line in (SAMPLE_CORPUS / "wiki_vital_leads.jsonl").read_text().splitlines()]
    assert all(set(r) == {"id", "text", "topic"} and len(r["text"]) <= 2000 for r in wiki)
    assert not (SAMPLE_CORPUS / "SAMPLE_CORPUS.md").exists()  # attribution lives outside the indexed folder
