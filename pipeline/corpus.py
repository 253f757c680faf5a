"""Corpus readers: the first stage of the builder, from files on disk to `SourceDoc` rows.

A corpus is one of
  * a folder tree mixing `.txt` / `.md` files (one document each, `doc_id` = POSIX path relative to the corpus
    root), `.jsonl` / `.jsonl.gz` and `.parquet` files (one document per record, `doc_id` = the id field as str)
    and folders written by `datasets.Dataset.save_to_disk` / `DatasetDict.save_to_disk` (one document per row);
  * a single such file, or a single saved dataset folder;
  * either of those on a store `pyarrow.fs` reads, named by URI (`s3://bucket/corpus`, `gs://...`, `hdfs://...`;
    `sift.storage`): the same files, credentials from the environment. Object stores have no symlinks, and a
    saved dataset there is an error row (`datasets` loads saved folders from local disk: copy it, or export it
    as Parquet).

Hidden files and folders (name starting with ".") are skipped; files with other extensions are ignored and listed
in a debug log. Symlinks: a file or dataset folder reached through a symlink that resolves inside the corpus folder
is read; one that resolves outside it is an error row unless `follow_symlinks` (config `corpus.follow_symlinks`);
a symlinked folder that is not a saved dataset is not descended into; dangling links and symlink loops are error
rows. The work is cut into `Source` units (a file, a dataset split, or a row range of a big parquet
file / split) so that one Ray task reads one unit:

    sources = list_sources(root)                                  # driver: cheap, sorted, deterministic
    docs = [d for s in sources for d in read_source(s)]          # workers: one task per source, in order
    docs = resolve_duplicates(docs)                               # driver: the duplicate-id policy

Bad content never raises: it becomes a `SourceDoc` with `error` set (a one-line reason and its fix), so the
builder can report every skipped document instead of silently losing it. Only a corpus that cannot be listed at
all (missing, unreadable, nothing readable in it) raises `SiftError`.

`SourceDoc.source` says where a document came from:
  * `notes/a.md`              a text file (the whole file is the document)
  * `data/x.jsonl#12`         a jsonl record; the number is the 1-based line number (as editors and `sed` count)
  * `data/x.parquet#3`        a parquet record; the number is the 0-based row index in the file
  * `saved:train#3`           a row of a saved dataset (`saved` = its folder relative to the corpus root,
                              `train` = the split of a DatasetDict; no `:split` for a plain Dataset); 0-based row
A row that cannot be read at all (corrupt parquet file, unreadable dataset) gets one error row whose `doc_id` and
`source` are the file's / split's label.
"""
from __future__ import annotations

import errno
import gzip
import json
import logging
import os
import posixpath
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sift.errors import SiftError
from sift.storage import Location, is_uri, redact

log = logging.getLogger(__name__)

SAMPLE_CORPUS = Path(__file__).parent / "sample_corpus"
"""The small corpus shipped with the package (see `pipeline/SAMPLE_CORPUS.md` for contents and attribution)."""

TEXT_SUFFIXES = (".txt", ".md")
RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
SUPPORTED = "a folder of .txt/.md/.jsonl/.jsonl.gz/.parquet files or a datasets.save_to_disk folder"

ROWS_PER_SOURCE = 10_000
"""Row ranges of big parquet files and dataset splits are cut to about this many rows per `Source`, so one Ray task
stays small (parquet cuts fall on row-group boundaries). jsonl files are one source each: split huge ones."""

_MAX_REASON = 200


@dataclass(frozen=True)
class Source:
    """One unit of reading work: a file, a saved-dataset split, or a row range of one of those.

    `root` is the absolute corpus root, or its URI (the folder the relative `path` and every text file's doc_id
    are relative to); `kind` is "text", "jsonl", "parquet" or "dataset"; `split` names a DatasetDict split (None
    for files and plain Datasets); rows `[start, stop)` of the file / split (`stop=None`: to the end). Plain data,
    so it pickles.
    """

    kind: str
    root: str
    path: str
    split: str | None = None
    start: int = 0
    stop: int | None = None

    @property
    def label(self) -> str:
        """The file's relative path, or `path:split` for a DatasetDict split."""
        return self.path if self.split is None else f"{self.path}:{self.split}"

    def sort_key(self) -> tuple[str, str, int]:
        return (self.path, self.split or "", self.start)


@dataclass(frozen=True)
class SourceDoc:
    doc_id: str
    text: str | None  # None when the record could not be read
    source: str  # "relative/path", "relative/path#line-or-row-number" or "dataset:split#row"
    error: str | None  # one-line reason (and fix) when the document cannot be indexed, else None


# ----------------------------------------------------------------------------------------------------------------
# Listing


def corpus_name(root: str | Path) -> str:
    """The corpus as a manifest records it: its resolved path, or its URI without credentials."""
    return redact(root) if is_uri(root) else str(Path(root).resolve())


def list_sources(root: str | Path) -> list[Source]:
    """Every unit of work under `root` (a path or a URI), sorted by (relative path, split, first row); raises
    `SiftError` if `root` is missing, unreadable, or holds nothing readable."""
    if is_uri(root):
        return sorted(_list_store(Location.of(root)), key=Source.sort_key)
    given = Path(root).expanduser()
    if not given.exists():
        raise SiftError(f"corpus not found: {given}; pass an existing folder or file ({SUPPORTED})")
    given = given.resolve()
    if given.is_file() or _dataset_kind(given) is not None:
        # A single file or a single saved dataset: its parent is the root, so labels and doc_ids keep its name.
        sources = _sources_for_entry(given.parent, given)
        if not sources:
            raise SiftError(f"unsupported corpus file: {given}; pass {SUPPORTED}")
        return sorted(sources, key=Source.sort_key)
    if not os.access(given, os.R_OK | os.X_OK):
        raise SiftError(f"corpus folder is not readable: {given}; fix its permissions")
    sources = _walk(given)
    if not sources:
        raise SiftError(f"no readable documents under {given}; put .txt/.md/.jsonl/.jsonl.gz/.parquet files "
                        "or a datasets.save_to_disk folder there")
    return sorted(sources, key=Source.sort_key)


def _walk(root: Path) -> list[Source]:
    """The sources of every visible file and saved dataset under the folder `root` (unsorted)."""

    def on_error(err: OSError) -> None:
        raise SiftError(f"cannot read corpus folder {err.filename}: {err.strerror}; fix its permissions")

    sources: list[Source] = []
    ignored: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=on_error):
        here = Path(dirpath)
        keep = []
        for name in sorted(dirnames):
            if name.startswith("."):
                continue
            sub = here / name
            if _dataset_kind(sub) is not None:
                sources += _sources_for_entry(root, sub)  # a dataset folder is a leaf: its .arrow files are its own
            else:
                keep.append(name)
        dirnames[:] = keep
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            found = _sources_for_entry(root, here / name)
            if found:
                sources += found
            else:
                ignored.append((here / name).relative_to(root).as_posix())
    if ignored:
        log.debug("corpus %s: ignored %d file(s) with other extensions: %s", root, len(ignored), ", ".join(ignored))
    return sources


def _list_store(corpus: Location) -> list[Source]:
    """The sources of a corpus named by URI: one file, or every visible file under the folder (unsorted)."""
    if corpus.local:  # a file:// URI is a local path
        return list_sources(corpus.root)
    try:
        if corpus.is_file(""):
            found = _store_sources(corpus.parent, [corpus.name])
            if not found:
                raise SiftError(f"unsupported corpus file: {corpus.uri}; pass {SUPPORTED}")
            return found
        files = corpus.files(recursive=True)
    except OSError as e:
        raise SiftError(f"cannot list corpus {corpus.uri}: {corpus.explain(e, 'read')}") from None
    if not files:
        raise SiftError(f"corpus not found: {corpus.uri} holds no files; pass an existing folder or file "
                        f"({SUPPORTED})")
    sources = _store_sources(corpus, [f for f in files if not any(p.startswith(".") for p in f.split("/"))])
    if not sources:
        raise SiftError(f"no readable documents under {corpus.uri}; put .txt/.md/.jsonl/.jsonl.gz/.parquet files "
                        "there")
    return sources


def _store_sources(corpus: Location, files: list[str]) -> list[Source]:
    """Sources of `files` (relative to `corpus`); a saved dataset folder becomes one source (an error row)."""
    datasets = sorted({posixpath.dirname(f) for f in files
                       if posixpath.basename(f) in ("dataset_dict.json", "dataset_info.json")})
    sources = [Source("dataset", corpus.spec, d or ".") for d in datasets]
    for rel in files:
        if any(d == "" or rel.startswith(d + "/") for d in datasets):
            continue
        suffix = _suffix(rel)
        if suffix in TEXT_SUFFIXES:
            sources.append(Source("text", corpus.spec, rel))
        elif suffix == ".parquet":
            sources += _parquet_sources(corpus.spec, rel)
        elif suffix:
            sources.append(Source("jsonl", corpus.spec, rel))
    return sources


def _where(root: str | Path, rel: str) -> tuple[str, object]:
    """(path, filesystem) of a corpus file, as pyarrow.parquet takes them (filesystem None: local)."""
    if is_uri(root):
        corpus = Location.of(root)
        return corpus.path(rel), corpus.fs
    return str(Path(root) / rel), None


def _read_bytes(root: str, rel: str) -> bytes:
    if is_uri(root):
        return Location.of(root).read_bytes(rel)
    return (Path(root) / rel).read_bytes()


def _dataset_kind(path: Path) -> str | None:
    """'dict' for a saved DatasetDict, 'dataset' for a saved Dataset, None otherwise."""
    if not path.is_dir():
        return None
    if (path / "dataset_dict.json").is_file():
        return "dict"
    if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
        return "dataset"
    return None


def _suffix(name: str) -> str:
    low = name.lower()
    for suffix in (*TEXT_SUFFIXES, *RECORD_SUFFIXES):
        if low.endswith(suffix):
            return suffix
    return ""


def _sources_for_entry(root: Path, path: Path) -> list[Source]:
    rel = path.relative_to(root).as_posix()
    kind = _dataset_kind(path)
    if kind == "dict":
        try:
            splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
        except (OSError, ValueError, KeyError, TypeError):
            # Listed as one source; reading it produces the error row that says what is wrong.
            return [Source("dataset", str(root), rel, split="?")]
        return [s for split in sorted(splits) for s in _dataset_sources(root, rel, split)]
    if kind == "dataset":
        return _dataset_sources(root, rel, None)
    suffix = _suffix(path.name)
    if suffix in TEXT_SUFFIXES:
        return [Source("text", str(root), rel)]
    if suffix == ".parquet":
        return _parquet_sources(root, rel)
    if suffix:
        return [Source("jsonl", str(root), rel)]
    return []


def _dataset_sources(root: Path, rel: str, split: str | None) -> list[Source]:
    try:
        n_rows = _load_split(root / rel, split).num_rows
    except Exception:  # noqa: BLE001 - any failure becomes the error row of read_source
        return [Source("dataset", str(root), rel, split=split)]
    return [Source("dataset", str(root), rel, split, start, min(start + ROWS_PER_SOURCE, n_rows))
            for start in range(0, max(n_rows, 1), ROWS_PER_SOURCE)]


def _parquet_sources(root: Path | str, rel: str) -> list[Source]:
    import pyarrow.parquet as pq

    try:
        path, fs = _where(root, rel)
        meta = pq.read_metadata(path, filesystem=fs)
    except Exception:  # noqa: BLE001 - a corrupt file is reported by read_source as one error row
        return [Source("parquet", str(root), rel)]
    if meta.num_rows <= ROWS_PER_SOURCE:
        return [Source("parquet", str(root), rel)]
    sources, start, stop = [], 0, 0
    for g in range(meta.num_row_groups):
        stop += meta.row_group(g).num_rows
        if stop - start >= ROWS_PER_SOURCE:
            sources.append(Source("parquet", str(root), rel, start=start, stop=stop))
            start = stop
    if stop > start:
        sources.append(Source("parquet", str(root), rel, start=start, stop=stop))
    return sources


# ----------------------------------------------------------------------------------------------------------------
# Reading


def read_source(source: Source, *, id_field: str = "id", text_field: str = "text",
                max_chars: int | None = None, follow_symlinks: bool = False) -> list[SourceDoc]:
    """The documents of one source, in row order. Never raises for bad content: a document that cannot be indexed
    is returned with `error` set. `max_chars`: longer documents become error rows (never truncated silently).
    `follow_symlinks`: read a source whose symlink resolves outside the corpus root (else it is an error row)."""
    if is_uri(source.root):
        if source.kind == "dataset":
            return [SourceDoc(source.label, None, source.label, "a saved dataset on a store read by URI; copy the "
                              "folder to local disk or export it as Parquet (datasets loads saved folders locally)")]
    elif link_error := _link_error(source, follow_symlinks):  # object stores have no symlinks
        return [SourceDoc(source.label, None, source.label, link_error)]
    check = _Checker(id_field, text_field, max_chars)
    if source.kind == "text":
        return [_read_text(source, check)]
    if source.kind == "jsonl":
        return _read_jsonl(source, check)
    if source.kind == "parquet":
        return _read_parquet(source, check)
    if source.kind == "dataset":
        return _read_dataset(source, check)
    raise ValueError(f"unknown source kind {source.kind!r}")  # programming error, not bad content


def _link_error(source: Source, follow_symlinks: bool) -> str | None:
    """Why the source's file or folder must not be read through its symlinks; None when it may be read."""
    root = Path(source.root).resolve()
    path = root / source.path
    try:
        real = path.resolve(strict=True)
    except RuntimeError:  # how Python before 3.13 reports a symlink loop
        return "symlink loop (the link leads back to itself); fix or remove the link"
    except OSError as err:
        if err.errno == errno.ELOOP:
            return "symlink loop (the link leads back to itself); fix or remove the link"
        if err.errno == errno.ENOENT and path.is_symlink():
            return f"broken symlink (its target {os.readlink(path)} does not exist); fix or remove the link"
        return None  # the reader reports it with its own reason
    if not follow_symlinks and not real.is_relative_to(root):
        return (f"symlink to {real}, outside the corpus folder; copy the file into the corpus, or set "
                "corpus.follow_symlinks = true to read files outside it")
    return None


def _read_failed(err: OSError) -> str:
    """The error row's reason for a file that cannot be opened, with the fix that matches the cause."""
    if err.errno in (errno.EACCES, errno.EPERM):
        fix = "fix its permissions"
    elif err.errno == errno.ENOENT:
        fix = "the file disappeared while the corpus was read; run sift-build again"
    else:
        fix = "check the file and the disk it is on"
    return f"cannot read file: {_one_line(err.strerror or err)}; {fix}"


def _one_line(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= _MAX_REASON else text[: _MAX_REASON - 3] + "..."


@dataclass(frozen=True)
class _Checker:
    id_field: str
    text_field: str
    max_chars: int | None

    def text_error(self, text: str) -> str | None:
        if not text.strip():
            return "empty document (whitespace only); add text or remove it from the corpus"
        if "\x00" in text:
            return "binary content (NUL character); remove it from the corpus or convert it to text"
        if self.max_chars is not None and len(text) > self.max_chars:
            return (f"document has {len(text)} characters, more than max_chars={self.max_chars}; "
                    "split it into smaller documents or raise max_chars")
        return None

    def missing_columns(self, names: list[str]) -> str | None:
        """For tabular sources (one schema for every row): the error when the id or text column is absent."""
        for field, setting in ((self.id_field, "id_field"), (self.text_field, "text_field")):
            if field not in names:
                return (f"no {field!r} column (columns: {_one_line(', '.join(names))}); "
                        f"rename the column or set {setting}")
        return None

    def record(self, fields: dict[str, Any], where: str) -> SourceDoc:
        """One jsonl / parquet / dataset record -> SourceDoc. `fields` holds the record's values by name."""
        if self.id_field not in fields:
            return SourceDoc(where, None, where, f"record has no {self.id_field!r} field "
                             f"(fields: {_one_line(', '.join(map(str, fields)))}); add it or set id_field")
        raw_id = fields[self.id_field]
        if raw_id is None:
            return SourceDoc(where, None, where, f"{self.id_field!r} is null; give the record an id")
        if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)):
            return SourceDoc(where, None, where, f"{self.id_field!r} has type {type(raw_id).__name__}, expected a "
                             "string or an integer; fix the record's id")
        doc_id = str(raw_id)
        if not doc_id.strip():
            return SourceDoc(where, None, where, f"{self.id_field!r} is empty; give the record a non-empty id")
        if self.text_field not in fields:
            return SourceDoc(doc_id, None, where, f"record has no {self.text_field!r} field "
                             f"(fields: {_one_line(', '.join(map(str, fields)))}); add it or set text_field")
        text = fields[self.text_field]
        if text is None:
            return SourceDoc(doc_id, None, where, f"{self.text_field!r} is null; give the record a text or remove it")
        if not isinstance(text, str):
            return SourceDoc(doc_id, None, where, f"{self.text_field!r} has type {type(text).__name__}, expected a "
                             "string; store the document's text as a string")
        return SourceDoc(doc_id, text, where, self.text_error(text))


def _read_text(source: Source, check: _Checker) -> SourceDoc:
    rel = source.path
    try:
        data = _read_bytes(source.root, rel)
    except OSError as err:
        return SourceDoc(rel, None, rel, _read_failed(err))
    nul = data.find(b"\x00")
    if nul >= 0:
        return SourceDoc(rel, None, rel, f"binary file (NUL byte at offset {nul}); "
                         "remove it from the corpus or convert it to text")
    try:
        text = data.decode("utf-8-sig")  # a UTF-8 byte-order mark is encoding metadata, not text
    except UnicodeDecodeError as err:
        return SourceDoc(rel, None, rel, f"not valid UTF-8 (byte 0x{data[err.start]:02x} at offset {err.start}); "
                         "re-encode the file as UTF-8")
    return SourceDoc(rel, text, rel, check.text_error(text))


def _read_jsonl(source: Source, check: _Checker) -> list[SourceDoc]:
    # Parsed line by line with the json module rather than pyarrow.json: a bad line must become one error row
    # with its line number, while pyarrow.json rejects the whole block, skips blank lines (losing the numbering)
    # and forces one type per column (ids mixing ints and strings are allowed here).
    rel = source.path
    try:
        data = _read_bytes(source.root, rel)
        if rel.lower().endswith(".gz"):
            data = gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as err:
        return [SourceDoc(rel, None, rel, f"cannot read file: {_one_line(err)}; "
                          "fix or re-create the file (a .jsonl.gz must be a complete gzip stream)")]
    docs = []
    for lineno, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue  # blank lines separate nothing in JSONL; they are not records
        where = f"{rel}#{lineno}"
        try:
            record = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as err:
            docs.append(SourceDoc(where, None, where, f"line is not valid UTF-8 (byte 0x{line[err.start]:02x} at "
                                  f"column {err.start + 1}); re-encode the file as UTF-8"))
            continue
        except ValueError as err:
            docs.append(SourceDoc(where, None, where, f"line is not valid JSON ({_one_line(err)}); "
                                  "fix the line or remove it"))
            continue
        if not isinstance(record, dict):
            docs.append(SourceDoc(where, None, where, f"line is a JSON {type(record).__name__}, expected an object "
                                  f"with {check.id_field!r} and {check.text_field!r}; fix the line or remove it"))
            continue
        docs.append(check.record(record, where))
    return docs


def _read_parquet(source: Source, check: _Checker) -> list[SourceDoc]:
    import pyarrow.parquet as pq

    rel = source.path
    try:
        path, fs = _where(source.root, rel)
        pf = pq.ParquetFile(path, filesystem=fs)
        names = pf.schema_arrow.names
        if missing := check.missing_columns(names):
            return [SourceDoc(rel, None, rel, missing)]
        columns = [check.id_field, check.text_field]
        if source.stop is None:
            table = pf.read(columns=columns)
        else:
            # [start, stop) is aligned to row groups by list_sources.
            groups, first = [], 0
            for g in range(pf.metadata.num_row_groups):
                if source.start <= first < source.stop:
                    groups.append(g)
                first += pf.metadata.row_group(g).num_rows
            table = pf.read_row_groups(groups, columns=columns)
    except Exception as err:  # noqa: BLE001 - pyarrow raises several types for corrupt files
        return [SourceDoc(rel, None, rel, f"corrupt or unreadable parquet file ({_one_line(err)}); "
                          "re-export the file")]
    return _records(check, table.to_pydict(), table.num_rows, rel, source.start)


def _load_split(path: Path, split: str | None):
    import datasets

    ds = datasets.load_from_disk(str(path))
    if split is None:
        if isinstance(ds, datasets.DatasetDict):
            raise ValueError("a DatasetDict where a Dataset was expected")
        return ds
    return ds[split]


def _read_dataset(source: Source, check: _Checker) -> list[SourceDoc]:
    label = source.label
    try:
        ds = _load_split(Path(source.root) / source.path, source.split)
        if missing := check.missing_columns(ds.column_names):
            return [SourceDoc(label, None, label, missing)]
        stop = ds.num_rows if source.stop is None else source.stop
        part = ds.select_columns([check.id_field, check.text_field])[source.start:stop]
    except Exception as err:  # noqa: BLE001 - datasets raises many types for a broken folder
        return [SourceDoc(label, None, label, f"cannot load saved dataset ({_one_line(err)}); "
                          "re-create it with save_to_disk")]
    return _records(check, part, stop - source.start, label, source.start)


def _records(check: _Checker, columns: dict[str, list], n_rows: int, label: str, first_row: int) -> list[SourceDoc]:
    """Column-wise records (the id and text columns) -> SourceDocs labelled `label#row`."""
    docs = []
    for i in range(n_rows):
        fields = {name: values[i] for name, values in columns.items()}
        docs.append(check.record(fields, f"{label}#{first_row + i}"))
    return docs


# ----------------------------------------------------------------------------------------------------------------
# Duplicate policy


class FirstOccurrence:
    """The duplicate-id policy, one document at a time, for documents given in source order (sources as
    `list_sources` sorts them, then row order, which is the order `read_source` returns).

    The first indexable occurrence of a doc_id wins; every later row with the same doc_id becomes an error row
    "duplicate doc_id, first seen in <source>", so no id is indexed twice and nothing disappears without a
    report. Rows that already carry an error pass through unchanged and claim no id.
    """

    def __init__(self):
        self.first_seen: dict[str, str] = {}

    def __call__(self, doc: SourceDoc) -> SourceDoc:
        if doc.error is None:
            if doc.doc_id in self.first_seen:
                return SourceDoc(doc.doc_id, doc.text, doc.source, f"duplicate doc_id, first seen in "
                                 f"{self.first_seen[doc.doc_id]}; give each document a unique id")
            self.first_seen[doc.doc_id] = doc.source
        return doc


def resolve_duplicates(docs: Iterable[SourceDoc]) -> list[SourceDoc]:
    """`FirstOccurrence` over documents given in source order."""
    policy = FirstOccurrence()
    return [policy(doc) for doc in docs]
