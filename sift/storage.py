"""Where an index or a corpus lives: a local folder, or a folder on a file system that `pyarrow.fs` reaches by URI.

    Location.of("index/sample")                                   a local folder (a relative path is made absolute)
    Location.of("file:///data/index")                             the same, as a URI
    Location.of("s3://bucket/index")                              S3; credentials from the environment, as the
                                                                  AWS SDK finds them (AWS_ACCESS_KEY_ID, profiles,
                                                                  instance roles)
    Location.of("s3://bucket/index?endpoint_override=host:9000&scheme=http")
                                                                  an S3-compatible server (MinIO, Ceph, moto)
    Location.of("gs://bucket/index"), Location.of("hdfs://namenode:8020/index")

Whatever `pyarrow.fs.FileSystem.from_uri` accepts is accepted. A local folder (a path or a `file://` URI) keeps the
POSIX guarantees the index relies on there (fsync, atomic rename, flock); every other store is an object store
to the index (`local` is False) and gets the commit protocol of docs/SPEC.md section 3.

An s3:// URI also takes how long one request may wait on the store, so that a store which stopped answering
fails the operation (naming the store) instead of holding it for minutes (`S3_TIMEOUTS`, the defaults):

    connect_timeout=5     seconds to open a connection
    request_timeout=5     seconds a request may go without receiving a byte
    max_attempts=3        attempts per request (AWS's standard retry strategy, with its backoff)

    Location.of("s3://bucket/index?endpoint_override=host:9000&scheme=http&request_timeout=30&max_attempts=5")

`spec` reopens the location in another process (a Ray actor) and may hold credentials given in the URI; it is
never printed or recorded. `uri` names the location to users and in manifests: credentials (user info, and query
parameters such as `secret_key` or `session_token`) are removed from it.
"""
from __future__ import annotations

import errno
import functools
import hashlib
import math
import os
import posixpath
import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pyarrow.fs as pafs

from sift.errors import SiftError

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_SECRET_PARAM = re.compile(r"key|secret|token|password|credential", re.IGNORECASE)
_BLOCK = 1 << 22

# The settings an s3:// URI takes beyond pyarrow's own query parameters, and their defaults (module docstring).
S3_TIMEOUTS = {"connect_timeout": 5.0, "request_timeout": 5.0, "max_attempts": 3}
# What an S3 error says when the request was refused for its credentials, or never answered.
_DENIED = ("ACCESS_DENIED", "INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH", "EXPIRED_TOKEN",
           "MISSING_AUTHENTICATION_TOKEN", "UNRECOGNIZED_CLIENT", "HTTP status 403")
_UNREACHABLE = ("NETWORK_CONNECTION", "curlCode", "Timeout was reached", "REQUEST_TIMEOUT", "SERVICE_UNAVAILABLE")


def is_uri(target: str | Path) -> bool:
    """True for `scheme://...` (a Path never is one: it cannot hold `//`)."""
    return isinstance(target, str) and bool(_URI.match(target))


def redact(uri: str) -> str:
    """The URI without its credentials: no user info, no query parameter whose name says key, secret or token."""
    parts = urlsplit(uri)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True)
                       if not _SECRET_PARAM.search(k)], safe=":/")
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


@dataclass(frozen=True)
class Location:
    """A folder on a file system. Paths below it are relative POSIX paths (`shards/part-1.parquet`)."""

    fs: pafs.FileSystem = field(repr=False, compare=False)
    root: str     # the folder as a path of `fs` (for a local folder, its absolute path)
    local: bool   # a local folder: POSIX semantics (fsync, rename, flock)
    uri: str      # how users see it: the absolute path, or the URI without credentials
    spec: str = field(repr=False)  # what `Location.of` takes to reopen it (may hold credentials)

    @classmethod
    def of(cls, target: "str | Path | Location") -> "Location":
        if isinstance(target, Location):
            return target
        if not is_uri(target):
            path = os.path.abspath(Path(target).expanduser())
            return cls(pafs.LocalFileSystem(), path, True, path, path)
        return _from_uri(str(target))

    @property
    def local_path(self) -> Path:
        """The folder as a Path (local folders only)."""
        assert self.local, self.uri
        return Path(self.root)

    @property
    def parent(self) -> "Location":
        """The folder that holds this one (on the same store: a URI keeps its query, endpoint included)."""
        if self.local:
            return Location.of(os.path.dirname(self.root))
        parts = urlsplit(self.spec)
        return Location.of(urlunsplit(parts._replace(path=posixpath.dirname(parts.path.rstrip("/")) or "/")))

    @property
    def name(self) -> str:
        return posixpath.basename(self.root.rstrip("/"))

    def path(self, rel: str = "") -> str:
        """`rel` as a path of `fs`."""
        return posixpath.join(self.root, rel) if rel else self.root

    def show(self, rel: str = "") -> str:
        """`rel` as users see it (messages, commands)."""
        if not rel:
            return self.uri
        if self.local:
            return str(Path(self.root) / rel)
        parts = urlsplit(self.uri)
        return urlunsplit(parts._replace(path=posixpath.join(parts.path, rel)))

    # ---------------------------------------------------------------------------------------------- queries

    def info(self, rel: str = "") -> pafs.FileInfo:
        return self.fs.get_file_info(self.path(rel))

    def is_file(self, rel: str) -> bool:
        return self.info(rel).type == pafs.FileType.File

    def is_dir(self, rel: str = "") -> bool:
        return self.info(rel).type == pafs.FileType.Directory

    def exists(self, rel: str = "") -> bool:
        return self.info(rel).type != pafs.FileType.NotFound

    def size(self, rel: str) -> int:
        return int(self.info(rel).size)

    def files(self, rel: str = "", *, recursive: bool = False) -> list[str]:
        """Relative paths of the files under `rel` (none when it does not exist), sorted."""
        selector = pafs.FileSelector(self.path(rel), allow_not_found=True, recursive=recursive)
        root = self.path()
        return sorted(posixpath.relpath(i.path, root) for i in self.fs.get_file_info(selector)
                      if i.type == pafs.FileType.File)

    # ------------------------------------------------------------------------------------------------ bytes

    def read_bytes(self, rel: str) -> bytes:
        with self.fs.open_input_stream(self.path(rel)) as f:
            return f.read()

    def sha256(self, rel: str) -> str:
        h = hashlib.sha256()
        with self.fs.open_input_stream(self.path(rel)) as f:
            while block := f.read(_BLOCK):
                h.update(block)
        return h.hexdigest()

    def open_input_file(self, rel: str):
        """A seekable file (what pyarrow.parquet reads)."""
        return self.fs.open_input_file(self.path(rel))

    def put(self, rel: str, data: bytes) -> None:
        """Write one object in one upload. On object stores a reader sees the previous object (or none) until
        the upload completes, then the new one whole; nothing here makes that so on a local folder."""
        with self.fs.open_output_stream(self.path(rel)) as f:
            f.write(data)

    def delete(self, rel: str) -> None:
        try:
            self.fs.delete_file(self.path(rel))
        except FileNotFoundError:
            pass

    # ----------------------------------------------------------------------------------------------- errors

    @property
    def endpoint(self) -> str:
        """The server this location's requests go to, as messages name it."""
        if isinstance(self.fs, pafs.S3FileSystem):
            options = self.fs.__reduce__()[1][0]
            return options["endpoint_override"] or f"AWS S3 ({options['region'] or 'the default region'})"
        return urlsplit(self.uri).netloc or self.uri

    def explain(self, e: OSError, action: str) -> str:
        """`what failed: what to do` for an OSError of this location's store, action being "read" or "write":
        the errno of a local folder, the error class of an S3 request (refused credentials, no answer)."""
        reason = e.strerror or next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        if self.local:
            if e.errno == errno.ENOSPC:
                return f"{reason}: free some space"
            if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                return f"{reason}: make {self.uri} {'writable' if action == 'write' else 'readable'}"
            return f"{reason}: check {self.uri}"
        if any(word in reason for word in _DENIED):
            return (f"{reason}: the store refused the credentials: check that credentials are set in the "
                    f"environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a profile or an instance role) "
                    f"and that they may {action} {self.uri}")
        if any(word in reason for word in _UNREACHABLE):
            return (f"{reason}: the store at {self.endpoint} could not be reached or did not answer: check that "
                    f"it is up and reachable (a request waits connect_timeout / request_timeout seconds, "
                    f"max_attempts times: URI parameters)")
        if "NO_SUCH_BUCKET" in reason:
            return f"{reason}: check that the bucket exists"
        return f"{reason}: check the bucket, the credentials in the environment and the endpoint {self.endpoint}"


def _split_timeouts(uri: str) -> tuple[str, dict[str, str]]:
    """The URI without the `S3_TIMEOUTS` parameters (the rest of it byte for byte), and those parameters."""
    base, _, query = uri.partition("?")
    keep, ours = [], {}
    for item in query.split("&") if query else []:
        key, _, value = item.partition("=")
        if key in S3_TIMEOUTS:
            ours[key] = value
        else:
            keep.append(item)
    return (f"{base}?{'&'.join(keep)}" if keep else base), ours


def _bounded(fs: pafs.S3FileSystem, given: dict[str, str], uri: str) -> pafs.S3FileSystem:
    """The same S3 file system with the `S3_TIMEOUTS` settings: the defaults, overridden by the URI's."""
    settings = dict(S3_TIMEOUTS)
    for key, text in given.items():
        kind = type(S3_TIMEOUTS[key])
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not 0 < value < math.inf:
            raise SiftError(f"{key}={text!r} in {redact(uri)} must be a {'whole ' if kind is int else ''}number "
                            f"> 0 (default {S3_TIMEOUTS[key]})")
        settings[key] = value
    options = dict(fs.__reduce__()[1][0])  # the options from_uri derived (endpoint, scheme, region, keys)
    options.update(connect_timeout=settings["connect_timeout"], request_timeout=settings["request_timeout"],
                   retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=settings["max_attempts"]))
    return pafs.S3FileSystem(**options)


@functools.lru_cache(maxsize=32)
def _from_uri(uri: str) -> Location:
    plain, timeouts = _split_timeouts(uri)
    try:
        fs, path = pafs.FileSystem.from_uri(plain)
    except (ValueError, OSError, TypeError) as e:
        raise SiftError(f"cannot open {redact(uri)}: {str(e).splitlines()[0] if str(e) else type(e).__name__}: "
                        f"give a local path or a URI pyarrow.fs reads (s3://, gs://, hdfs://, file://)") from None
    if isinstance(fs, pafs.S3FileSystem):
        fs = _bounded(fs, timeouts, uri)
    elif timeouts:
        raise SiftError(f"{', '.join(timeouts)} in {redact(uri)} applies to s3:// URIs only: remove it")
    if isinstance(fs, pafs.LocalFileSystem):
        return Location(fs, path, True, path, path)
    return Location(fs, path.rstrip("/"), False, redact(uri), uri)
