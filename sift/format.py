"""The SIFT index format (docs/SPEC.md sections 2-3): what the builder writes and the runtime reads.

    INDEX/
      .sift-index                   marker: this folder is a SIFT index (written before anything else)
      .lock                         held (flock) by the one builder writing the folder; on an object store a
                                    lease object (owner, host, pid, expiry) that the builder renews
      manifest.json                 the only file ever replaced: temp file, fsync, rename, fsync(dir); on an
                                    object store one put, written after everything it lists
      manifests/gen-N.json          a copy of every committed manifest (history; recovery from a bad or lost
                                    manifest.json), written once: generation numbers never go back
      shards/part-<sha>.parquet     document rows (DOCS_SCHEMA), named by the sha256 of their bytes, never modified
      shards/errors-<sha>.parquet   the errors table of a generation (ERRORS_SCHEMA)

The index may live in a local folder or on an object store (`sift.storage.Location`: s3://, gs://, hdfs://);
docs/SPEC.md section 3 gives the commit protocol of each. A manifest is trusted only inside its folder: every
file it lists must be `shards/<name>.parquet` and must not lead outside the index through a symlink, or the
index is refused before any listed file is opened.

This module owns the names, schemas and sizes of that layout, the typed manifest (`Manifest`, `ShardInfo`,
`ModelIdentity`) and the read-only view of one committed generation (`IndexReader`). Writing lives in the
builder (`sift.pipeline.index`); both halves import this module and nothing of each other.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sift.errors import SiftError
from sift.storage import Location

FORMAT = "sift-index"
FORMAT_VERSION = 1
MARKER = ".sift-index"
MANIFEST = "manifest.json"
HISTORY = "manifests"
SHARDS = "shards"
PROFILE_KEY_META = b"sift.profile_key"
BACKEND_META = b"sift.backend"

# Tile (page) sizes an index may use, and so the block sizes the kernels accept (SPEC section 1).
TILES = (16, 32, 64, 128)

DOCS_SCHEMA = pa.schema([
    ("doc_id", pa.string()),
    ("content_hash", pa.string()),
    ("n_tokens", pa.int32()),
    ("la_bits", pa.binary()),
    ("ca_bits", pa.binary()),
    ("source", pa.string()),
    ("la_density", pa.list_(pa.float32())),  # per layer, mean over heads of the fraction of LA tiles kept
    ("ca_density", pa.list_(pa.float32())),  # per layer, mean over heads of the fraction of CA pages kept
])
ERRORS_SCHEMA = pa.schema([("doc_id", pa.string()), ("source", pa.string()), ("reason", pa.string())])


# ------------------------------------------------------------------------------------ bit-vector sizes


def n_pages(n_tokens: int, tile: int) -> int:
    """P = ceil(L / T)."""
    return -(-n_tokens // tile)


def la_nbytes(n_tokens: int, tile: int) -> int:
    """Bytes of one (layer, head) LA vector: ceil(P(P+1)/2 / 8)."""
    p = n_pages(n_tokens, tile)
    return math.ceil(p * (p + 1) // 2 / 8)


def ca_nbytes(n_tokens: int, tile: int) -> int:
    """Bytes of one (layer, head) CA vector: ceil(P / 8)."""
    return math.ceil(n_pages(n_tokens, tile) / 8)


# ------------------------------------------------------------------------------------------- hashing


def content_hash(token_ids) -> str:
    """SPEC section 3: hex sha256 of the document's token ids as little-endian int32."""
    return hashlib.sha256(np.asarray(token_ids, dtype="<i4").tobytes()).hexdigest()


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 4 MiB blocks (shards, model weights)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------- the manifest


@dataclass(frozen=True)
class ShardInfo:
    """One immutable Parquet file of a generation."""

    path: str      # relative to the index root
    rows: int
    bytes: int
    sha256: str
    backend: str   # what profiled its rows ("torch", "triton+cudnn-lse", ...), "" for the errors table

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ModelGeometry:
    """A decoder's attention shape, worked out from its transformers config in this one place: what an index's
    bits (n_layers x n_heads vectors) and a KV page (n_layers x n_kv_heads x head_dim) are sized by."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config) -> "ModelGeometry":
        """From a transformers config: num_key_value_heads defaults to num_attention_heads (no GQA), head_dim to
        hidden_size / num_attention_heads."""
        n_heads = config.num_attention_heads
        return cls(n_layers=config.num_hidden_layers, n_heads=n_heads,
                   n_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // n_heads)


@dataclass(frozen=True)
class ModelIdentity:
    """What an index records about the model that produced it (SPEC section 3)."""

    name: str
    fingerprint: str
    model_type: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope: dict
    max_position_embeddings: int

    @classmethod
    def from_config(cls, name: str, fp: str, config) -> "ModelIdentity":
        """From a transformers config object."""
        rope = dict(getattr(config, "rope_parameters", None) or {})
        return cls(name=name, fingerprint=fp, model_type=config.model_type,
                   **asdict(ModelGeometry.from_config(config)), rope=json.loads(json.dumps(rope, default=float)),
                   max_position_embeddings=getattr(config, "max_position_embeddings", 0) or 0)

    @property
    def geometry(self) -> ModelGeometry:
        return ModelGeometry(self.n_layers, self.n_heads, self.n_kv_heads, self.head_dim)

    def to_dict(self) -> dict:
        return asdict(self)


# Keys every manifest must hold, with their JSON types; checked before anything reads one.
_REQUIRED = {"format": str, "format_version": int, "generation": int, "model": dict, "profile": dict, "shards": list}
_REQUIRED_MODEL = {"fingerprint": str, "n_layers": int, "n_heads": int, "n_kv_heads": int, "head_dim": int}
_REQUIRED_PROFILE = {"tile": int, "prefix_token_ids": list}
_REQUIRED_SHARD = {"path": str, "rows": int, "bytes": int, "sha256": str}
# Keys a manifest may omit; when present they must have these types.
_OPTIONAL = {"created_at": str, "corpus": dict, "backends": list, "documents": int, "tokens": int,
             "last_build": dict}
_OPTIONAL_MODEL = {"name": str, "model_type": str, "rope": dict, "max_position_embeddings": int}
_OPTIONAL_SHARD = {"backend": str}
_RESTORE = f"restore it from {HISTORY}/gen-N.json (the last good copy) or rebuild the index"


def _check_type(where: str, key: str, value, kind: type) -> None:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise SiftError(f"{where}: {key} is {type(value).__name__}, expected {kind.__name__}: the manifest is "
                        f"corrupt; {_RESTORE}")


def _check_keys(where: str, value: dict, required: dict, optional: dict, prefix: str = "") -> None:
    for key, kind in required.items():
        if key not in value:
            raise SiftError(f"{where} has no {prefix}{key}: the manifest is incomplete; {_RESTORE}")
        _check_type(where, prefix + key, value[key], kind)
    for key, kind in optional.items():
        if value.get(key) is not None:
            _check_type(where, prefix + key, value[key], kind)


def _check_shard_path(where: str, rel: str) -> None:
    """A listed file must be `shards/<name>.parquet`: never `..`, an absolute path or another folder, so a
    manifest cannot make a reader open (or reveal the existence of) a file outside the index."""
    parts = rel.split("/")
    if (len(parts) != 2 or parts[0] != SHARDS or parts[1].startswith(".") or "\\" in rel
            or not parts[1].endswith(".parquet")):
        raise SiftError(f"{where} lists the file {rel!r}, which is not shards/<name>.parquet inside the index: "
                        f"the manifest is corrupt; {_RESTORE}")


def _check_manifest(d: dict, where: str) -> None:
    _check_keys(where, d, _REQUIRED, _OPTIONAL)
    _check_keys(where, d["model"], _REQUIRED_MODEL, _OPTIONAL_MODEL, "model.")
    _check_keys(where, d["profile"], _REQUIRED_PROFILE, {}, "profile.")
    if d["generation"] < 1:
        raise SiftError(f"{where}: generation {d['generation']} is not >= 1: the manifest is corrupt; {_RESTORE}")
    if d.get("errors") is not None and not isinstance(d["errors"], dict):
        _check_type(where, "errors", d["errors"], dict)
    for e in list(d["shards"]) + ([d["errors"]] if d.get("errors") else []):
        if not isinstance(e, dict):
            raise SiftError(f"{where}: a shard entry is {type(e).__name__}, not an object: the manifest is "
                            f"corrupt; {_RESTORE}")
        _check_keys(where, e, _REQUIRED_SHARD, _OPTIONAL_SHARD, "shards[].")
        _check_shard_path(where, e["path"])
        if e["rows"] < 0 or e["bytes"] < 0:
            raise SiftError(f"{where}: shard {e['path']} has a negative size: the manifest is corrupt; {_RESTORE}")


@dataclass(frozen=True)
class Manifest:
    """One committed generation (manifest.json). `profile` is the profile config plus `prefix_token_ids` and
    `profile_key`; `corpus` the corpus config plus its path and `max_tokens`; `last_build` what the build did."""

    generation: int
    created_at: str
    model: ModelIdentity
    profile: dict
    corpus: dict
    backends: list[str]
    shards: list[ShardInfo]
    errors: ShardInfo | None
    documents: int
    tokens: int
    last_build: dict = field(default_factory=dict)
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    @property
    def tile(self) -> int:
        return int(self.profile["tile"])

    @property
    def profile_key(self) -> str:
        return str(self.profile.get("profile_key", ""))

    @property
    def prefix_token_ids(self) -> tuple[int, ...]:
        return tuple(self.profile["prefix_token_ids"])

    def files(self) -> list[ShardInfo]:
        """Every file the generation lists: its document shards, then its errors table if any."""
        return list(self.shards) + ([self.errors] if self.errors else [])

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["model"] = self.model.to_dict()
        d["shards"] = [s.to_dict() for s in self.shards]
        d["errors"] = self.errors.to_dict() if self.errors else None
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, d, where: str = MANIFEST) -> "Manifest":
        """Validate and type a manifest read from JSON; SiftError naming the first problem."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            found = d.get("format") if isinstance(d, dict) else None
            raise SiftError(f"{where} is not a SIFT manifest (format {found!r}): rebuild the index")
        if d.get("format_version") != FORMAT_VERSION:
            raise SiftError(f"{where} has format_version {d.get('format_version')!r}; this version reads "
                            f"{FORMAT_VERSION}: rebuild the index or upgrade sift")
        _check_manifest(d, where)

        def shard(e: dict) -> ShardInfo:
            return ShardInfo(path=e["path"], rows=e["rows"], bytes=e["bytes"], sha256=e["sha256"],
                             backend=e.get("backend", ""))

        m = d["model"]
        model = ModelIdentity(name=str(m.get("name", "")), fingerprint=m["fingerprint"],
                              model_type=str(m.get("model_type", "")), n_layers=m["n_layers"],
                              n_heads=m["n_heads"], n_kv_heads=m["n_kv_heads"], head_dim=m["head_dim"],
                              rope=dict(m.get("rope") or {}),
                              max_position_embeddings=int(m.get("max_position_embeddings") or 0))
        n_rows = sum(e["rows"] for e in d["shards"])
        return cls(generation=d["generation"], created_at=str(d.get("created_at", "")), model=model,
                   profile=d["profile"], corpus=dict(d.get("corpus") or {}), backends=list(d.get("backends") or []),
                   shards=[shard(e) for e in d["shards"]], errors=shard(d["errors"]) if d.get("errors") else None,
                   documents=int(d.get("documents", n_rows)), tokens=int(d.get("tokens", 0)),
                   last_build=dict(d.get("last_build") or {}))


def history(index: Location) -> dict[int, str]:
    """generation -> `manifests/gen-N.json` (relative to the index) for every history file of the index."""
    found = {}
    for rel in Location.of(index).files(HISTORY):
        name = rel.rsplit("/", 1)[-1]
        number = name[len("gen-"):-len(".json")]
        if name.startswith("gen-") and name.endswith(".json") and number.isdigit():
            found[int(number)] = rel
    return found


def restore_command(index: Location) -> str:
    """The command that makes the newest history file the live manifest again."""
    index = Location.of(index)
    newest = max(history(index), default=None)
    if newest is None:
        return "rebuild the index"
    source, target = index.show(f"{HISTORY}/gen-{newest}.json"), index.show(MANIFEST)
    return f"cp {source} {target}" if index.local else f"copy {source} to {target}"


def _read_text(index: Location, rel: str) -> str:
    if index.local:
        return (index.local_path / rel).read_text()
    return index.read_bytes(rel).decode()


def load_manifest(index: Location, rel: str) -> Manifest:
    """Read and validate one manifest file (manifest.json or a history copy); SiftError naming a bad one."""
    where = index.show(rel)
    try:
        raw = json.loads(_read_text(index, rel))
    except OSError as e:
        raise SiftError(f"cannot read {where}: {index.explain(e, 'read')}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise SiftError(f"{where} is corrupt ({e}): restore it from {index.show(HISTORY)}/gen-N.json "
                        f"(the last good copy) or rebuild the index") from None
    return Manifest.from_dict(raw, where)


def read_manifest(index: Location) -> Manifest | None:
    """The committed manifest, None for an index with no generation yet; SiftError naming a bad one, and for a
    missing manifest.json whose history shows generations were committed (it must be restored, not ignored)."""
    index = Location.of(index)
    if not index.is_file(MANIFEST):
        if not index.is_file(MARKER):
            raise SiftError(f"{index.uri} is not a SIFT index (no {MANIFEST}): build one with `sift-build`")
        if history(index):
            raise SiftError(f"{index.show(MANIFEST)} is missing although {index.show(HISTORY)} holds committed "
                            f"generations: restore the newest with `{restore_command(index)}`")
        return None
    return load_manifest(index, MANIFEST)


# ------------------------------------------------------------------------------------------- reading


def _inside(root: Path, rel: str) -> Path:
    """root / rel, refused when a symlink takes it outside `root`; the target itself is never opened."""
    path = root / rel
    real_root = os.path.realpath(root)
    if os.path.commonpath([real_root, os.path.realpath(path)]) != real_root:
        raise SiftError(f"index {root} is corrupt: {rel} leads outside the index folder (a symlink): rebuild "
                        f"the index")
    return path


def read_parquet(index: Location, rel: str, columns: list[str] | None = None) -> pa.Table:
    """A whole shard; SiftError when the file is not readable Parquet (whatever its checksum says)."""
    try:
        return pq.read_table(index.path(rel), filesystem=index.fs, columns=columns)
    except OSError as e:  # the folder or the store failed, whatever the file holds
        raise SiftError(f"cannot read shard {index.show(rel)}: {index.explain(e, 'read')}") from None
    except pa.ArrowException as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SiftError(f"shard {index.show(rel)} is not a readable Parquet file ({reason}): rebuild the "
                        f"index") from None


def _sha256(index: Location, rel: str) -> str:
    return sha256_file(index.local_path / rel) if index.local else index.sha256(rel)


class IndexReader:
    """Read-only view of one committed generation, with checksums verified (plain pyarrow underneath), in a
    local folder or on an object store (`sift.storage.Location`).

    Opening refuses a generation whose files lead outside the index folder, before any of them is read."""

    def __init__(self, index: Location, manifest: Manifest):
        self.location = Location.of(index)
        self.manifest = manifest
        for e in manifest.files():
            self._checked(e.path)

    @classmethod
    def open(cls, path: "str | Path | Location", *, verify: bool = True) -> "IndexReader":
        """path: a folder, or a URI `sift.storage` opens (s3://, gs://, hdfs://, file://). SiftError for
        everything that keeps the index from being read, a store that refuses or does not answer included."""
        index = Location.of(path)
        try:
            return cls._open(index, verify)
        except OSError as e:
            raise SiftError(f"cannot read index {index.uri}: {index.explain(e, 'read')}") from None

    @classmethod
    def _open(cls, index: Location, verify: bool) -> "IndexReader":
        if not index.is_dir():
            raise SiftError(f"index {index.uri} does not exist: build it with `sift-build CORPUS --out "
                            f"{index.uri}`")
        manifest = read_manifest(index)
        if manifest is None:
            raise SiftError(f"index {index.uri} has no committed generation yet (a first build is running or was "
                            f"killed): run `sift-build` to finish it")
        reader = cls(index, manifest)
        if verify:
            reader.verify()
        return reader

    @property
    def generation(self) -> int:
        return self.manifest.generation

    def _checked(self, rel: str) -> str:
        """`rel`, refused when a local symlink takes it outside the index folder (object stores have none)."""
        if self.location.local:
            _inside(self.location.local_path, rel)
        return rel

    def show(self, info: ShardInfo) -> str:
        """Where a file of this generation is, as users see it."""
        return self.location.show(info.path)

    def read(self, info: ShardInfo, columns: list[str] | None = None) -> pa.Table:
        """One file of this generation (checked to be inside the index folder)."""
        return read_parquet(self.location, self._checked(info.path), columns)

    def verify(self) -> None:
        for e in self.manifest.files():
            rel, where = self._checked(e.path), self.show(e)
            if not self.location.is_file(rel):
                raise SiftError(f"shard {where} listed in the manifest is missing: rebuild the index")
            if self.location.size(rel) != e.bytes or _sha256(self.location, rel) != e.sha256:
                raise SiftError(f"shard {where} is corrupt (sha256 does not match the manifest): rebuild the "
                                f"index (`sift-build` re-profiles its documents)")

    def table(self, columns: list[str] | None = None) -> pa.Table:
        """All document rows of this generation."""
        tables = [self.read(s, columns) for s in self.manifest.shards]
        if not tables:
            schema = DOCS_SCHEMA if columns is None else pa.schema([DOCS_SCHEMA.field(c) for c in columns])
            return schema.empty_table()
        return pa.concat_tables([t.replace_schema_metadata(None) for t in tables])

    def errors(self) -> pa.Table:
        e = self.manifest.errors
        if not e:
            return ERRORS_SCHEMA.empty_table()
        return self.read(e).replace_schema_metadata(None)
