"""Indexes and corpora on an object store, against a real S3 protocol server (moto's server mode, started here)
through pyarrow's S3FileSystem: build, incremental rebuild, sift-inspect and SiftIndex on the URI, a reader and a
second build during a build, kill -9 mid-build and the resumed build, and the lease that stands in for flock.

Credentials come from the environment (the fake ones moto accepts); the corpus URI also carries a secret
(`s3://KEY:SECRET@bucket/...`), which must not reach the manifest."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from sift import format as fmt
from sift.errors import SiftError
from sift.format import IndexReader
from sift.pipeline import index as idx
from sift.pipeline.cli import inspect_main
from sift.pipeline.config import load_config
from sift.pipeline.job import run_build
from sift.runtime import SiftIndex
from sift.storage import Location, redact

from .test_build import make_corpus, write_config
from .test_reliability import BIN, assert_one_line_failure
from .test_store import LENGTHS, make_index

BUCKET = "sift"
SECRET = "uri-secret-never-recorded"
ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
       "AWS_EC2_METADATA_DISABLED": "true"}


SERVERS: dict[str, subprocess.Popen] = {}  # endpoint -> the moto server process (a test freezes it)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3():
    """host:port of a moto S3 server holding an empty bucket; AWS credentials in the environment meanwhile."""
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"127.0.0.1:{port}"
    SERVERS[endpoint] = server
    try:
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://{endpoint}/", timeout=1)
                break
            except OSError:
                if time.time() > deadline or server.poll() is not None:
                    raise RuntimeError("the moto S3 server did not start")
                time.sleep(0.1)
        pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", allow_bucket_creation=True).create_dir(BUCKET)
        yield endpoint
    finally:
        SERVERS.pop(endpoint)
        server.terminate()
        server.wait()
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture(scope="module")
def ray_session(s3):
    """Ray started after the credentials are in the environment, so its workers (which write shards) have them."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def uri(endpoint: str, prefix: str, credentials: str = "") -> str:
    return f"s3://{credentials}{BUCKET}/{prefix}?endpoint_override={endpoint}&scheme=http"


def upload_corpus(local, target: Location) -> None:
    for f in sorted(local.iterdir()):
        target.put(f.name, f.read_bytes())


def rows_by_id(index: str) -> dict:
    t = IndexReader.open(index).table()
    ids = t["doc_id"].to_pylist()
    assert len(ids) == len(set(ids)), "an id appears twice in the live index"
    return {r["doc_id"]: r for r in t.to_pylist()}


def quiet(*_):
    pass


def copy_prefix(src: Location, dst: Location) -> None:
    """A copy of every object under `src` (server-side copies), so a test may change it."""
    for rel in src.files(recursive=True):
        src.fs.copy_file(src.path(rel), dst.path(rel))


@pytest.fixture(scope="module")
def built(s3, ray_session, tmp_path_factory):
    """Generation 1 of a four-document corpus read from S3 (its URI carries credentials, which moto accepts),
    built into S3: -> (corpus URI, index URI, the corpus's file names, the local config)."""
    root = tmp_path_factory.mktemp("object-store")
    names = make_corpus(root / "corpus", 4)
    corpus_uri = uri(s3, "built/corpus", f"testing:{SECRET}@")
    upload_corpus(root / "corpus", Location.of(corpus_uri))
    Location.of(corpus_uri).put(".hidden.txt", b"never read")
    index = uri(s3, "built/index")
    stats = run_build(corpus_uri, index, load_config(write_config(root / "c.toml", shard_rows=2)), echo=quiet)
    assert (stats.generation, stats.profiled, stats.reused, stats.errors) == (1, 4, 0, 0)
    return corpus_uri, index, names, root / "c.toml"


def copy_built(built, s3, name: str) -> tuple[str, str]:
    """The built corpus and index copied to `name/` (credentials from the environment): (corpus, index) URIs."""
    corpus, index = uri(s3, f"{name}/corpus"), uri(s3, f"{name}/index")
    copy_prefix(Location.of(built[0]), Location.of(corpus))
    copy_prefix(Location.of(built[1]), Location.of(index))
    return corpus, index


# ------------------------------------------------------------------------------ build, rebuild, inspect


def test_build_on_s3_reads_with_plain_pyarrow_and_records_no_credentials(s3, built):
    corpus_uri, index, names, _ = built
    assert set(rows_by_id(index)) == set(names)
    fs = pafs.S3FileSystem(endpoint_override=s3, scheme="http")
    with fs.open_input_stream(f"{BUCKET}/built/index/manifest.json") as f:
        raw = f.read().decode()
    manifest = json.loads(raw)
    assert manifest["generation"] == 1 and SECRET not in raw
    assert manifest["corpus"]["path"] == redact(corpus_uri)
    for s in manifest["shards"]:
        assert fs.get_file_info(f"{BUCKET}/built/index/{s['path']}").size == s["bytes"]


def test_incremental_rebuild_serve_and_inspect_on_s3(s3, built):
    corpus_uri, index = copy_built(built, s3, "rebuild")
    names, config = built[2], built[3]
    before = rows_by_id(index)
    # One document changed, one added, one deleted: only the changed and the new one are profiled.
    corpus = Location.of(corpus_uri)
    corpus.put(names[1], corpus.read_bytes(names[1]) + b" Changed.")
    corpus.put("new.txt", b"A new document about the history of printing presses in Europe.")
    corpus.delete(names[3])
    second = run_build(corpus_uri, index, load_config(config), echo=quiet)
    assert (second.generation, second.profiled, second.reused, second.deleted) == (2, 2, 2, 1)
    after = rows_by_id(index)
    assert set(after) == set(before) - {names[3]} | {"new.txt"}
    for name in (names[0], names[2]):
        assert (after[name]["la_bits"], after[name]["ca_bits"]) == (before[name]["la_bits"], before[name]["ca_bits"])
    # What neither generation 2 nor generation 1 lists is deleted; the history keeps both manifests.
    store = Location.of(index)
    gens = {n: fmt.load_manifest(store, rel) for n, rel in fmt.history(store).items()}
    assert sorted(gens) == [1, 2]
    assert set(store.files(fmt.SHARDS)) == {f.path for m in gens.values() for f in m.files()}

    served = SiftIndex.open(index, device="cpu")
    assert (served.generation, len(served), served.path) == (2, 4, redact(index))
    assert served.entry(names[0]).la.numpy().tobytes() == before[names[0]]["la_bits"]

    result = CliRunner().invoke(inspect_main, [index, "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert (summary["path"], summary["generation"], summary["documents"]) == (redact(index), 2, 4)
    assert summary["last_build"]["profiled"] == 2


# ------------------------------------------------------------- kill -9 mid-build, a reader and a second build


def test_kill_mid_build_reader_and_second_build_then_resume(s3, ray_session, built, tmp_path):
    _, index = copy_built(built, s3, "kill")
    names = make_corpus(tmp_path / "corpus", 4)  # the built corpus's files, on local disk this time
    corpus = tmp_path / "corpus"
    config = write_config(tmp_path / "c.toml", shard_rows=1)
    gen1 = rows_by_id(index)
    assert set(gen1) == set(names)

    more = make_corpus(tmp_path / "more", 8, chars=400)
    for name in more:
        (corpus / f"more-{name}").write_text((tmp_path / "more" / name).read_text())
    store = Location.of(index)
    # The CLI joins this test's Ray cluster (no second cluster to start); killing it kills its driver, and Ray
    # then ends the job's actors.
    address = ray_session.get_runtime_context().gcs_address
    proc = subprocess.Popen([str(BIN / "sift-build"), str(corpus), "--out", index, "--config", str(config), "-q",
                             "--ray-address", address],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    seen, refused = set(), None
    try:
        while time.time() < deadline:
            # A reader during the build sees a whole committed generation: the previous one.
            reader = IndexReader.open(index)
            assert reader.table(["doc_id"]).num_rows == reader.manifest.documents
            seen.add(reader.generation)
            new = [p for p in store.files(fmt.SHARDS) if p not in {s.path for s in reader.manifest.shards}]
            if refused is None and store.is_file(idx.LOCK):
                with pytest.raises(SiftError) as refused:  # a second build while the first holds the lease
                    run_build(corpus, index, load_config(config), echo=quiet)
            if len(new) >= 2:
                break
            time.sleep(0.5)
        else:
            pytest.fail("the build wrote no shard in time")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the build's driver, mid-run
        proc.wait()
    assert seen == {1}
    assert refused is not None and "another sift-build is writing" in str(refused.value)
    assert "\n" not in str(refused.value)
    assert rows_by_id(index).keys() == gen1.keys()  # the previous generation, whole

    # The killed build's lease names a process of this host that is gone: the next build takes it over at once.
    stats = run_build(corpus, index, load_config(config), echo=quiet)
    assert stats.generation == 2 and stats.reused_orphans >= 2
    assert stats.reused == 4 and stats.profiled + stats.reused_orphans == 8
    final = rows_by_id(index)
    assert set(final) == set(names) | {f"more-{n}" for n in more}
    for name in names:
        assert final[name]["la_bits"] == gen1[name]["la_bits"]
    assert not store.is_file(idx.LOCK)


# ------------------------------------------------------------------------------------- the lease and commit


def _lock(store: Location, **record) -> None:
    store.put(idx.LOCK, json.dumps({"owner": "someone", "host": "elsewhere", "pid": 1, **record}).encode())


def test_lease_refuses_a_live_owner_and_takes_over_dead_ones(s3):
    store = Location.of(uri(s3, "index-lease"))
    idx.prepare_dir(store)
    _lock(store, expires=time.time() + 600, expires_utc="later")
    with pytest.raises(SiftError, match="another sift-build is writing .* held by elsewhere pid 1 until later"):
        with idx.build_lock(store):
            pass

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for record in ({"expires": time.time() - 1},                                        # expired
                   {"expires": time.time() + 600, "host": socket.gethostname(), "pid": dead.pid}):  # owner gone
        _lock(store, **record)
        with idx.build_lock(store) as lease:
            lease.check()
            assert json.loads(store.read_bytes(idx.LOCK))["owner"] == lease.token
        assert not store.is_file(idx.LOCK)

    with idx.build_lock(store) as lease:
        _lock(store, expires=time.time() + 600)  # another build took the lock over
        with pytest.raises(SiftError, match="lost its lock"):
            lease.check()
    assert json.loads(store.read_bytes(idx.LOCK))["owner"] == "someone"  # its lock is left alone


def test_commit_on_s3_is_write_once_and_a_failed_publish_keeps_the_previous(s3, monkeypatch):
    store = Location.of(uri(s3, "index-commit"))
    rows = make_index(store)
    reader = IndexReader.open(store)
    assert reader.generation == 1 and set(reader.table(["doc_id"])["doc_id"].to_pylist()) == set(LENGTHS)
    before = store.read_bytes(fmt.MANIFEST)
    served = SiftIndex.open(store.spec, device="cpu")
    for doc_id, row in rows.items():
        entry = served.entry(doc_id)
        assert torch.equal(entry.la, torch.frombuffer(bytearray(row["la_bits"]), dtype=torch.uint8))

    with pytest.raises(SiftError, match="gen-1.json.* already exists"):
        idx.commit_manifest(store, reader.manifest)  # a history file is never rewritten

    store.put(f"{fmt.HISTORY}/gen-2.json", b"{ begun, never committed")
    assert idx.next_generation(store, reader.manifest) == 3
    nxt = fmt.Manifest.from_dict({**reader.manifest.to_dict(), "generation": 3})
    put = Location.put

    def failing(self, rel, data):
        if rel == fmt.MANIFEST:
            raise OSError("AWS Error ACCESS_DENIED during PutObject operation")
        put(self, rel, data)

    monkeypatch.setattr(Location, "put", failing)
    with pytest.raises(SiftError, match="cannot write .*manifest.json.*ACCESS_DENIED.*previous generation is "
                                        "unchanged"):
        idx.commit_manifest(store, nxt)
    assert store.read_bytes(fmt.MANIFEST) == before and not store.exists(f"{fmt.HISTORY}/gen-3.json")
    assert IndexReader.open(store).generation == 1


def test_missing_bucket_and_bad_uri_are_one_line(s3, tmp_path):
    with pytest.raises(SiftError, match="cannot create the index .*no-such-bucket.*bucket exists"):
        idx.prepare_dir(uri(s3, "x").replace(BUCKET, "no-such-bucket"))
    with pytest.raises(SiftError, match="index .* does not exist"):
        IndexReader.open(uri(s3, "never-built"))
    with pytest.raises(SiftError, match="cannot open nosuchscheme://x"):
        Location.of("nosuchscheme://x")


def test_file_uri_is_a_local_folder(tmp_path):
    make_index(tmp_path / "index")
    local = Location.of(f"file://{tmp_path}/index")
    assert local.local and local.root == str(tmp_path / "index")
    assert IndexReader.open(f"file://{tmp_path}/index").generation == 1
    assert redact("s3://key:pw@b/i?access_key=a&secret_key=s&session_token=t&scheme=http") == "s3://b/i?scheme=http"


def test_corpus_files_on_s3(s3, tmp_path):
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    from sift.pipeline.corpus import list_sources, read_source

    corpus = Location.of(uri(s3, "corpus-kinds"))
    corpus.put("notes/a.md", "A note.".encode())
    corpus.put("records.jsonl.gz", gzip.compress(b'{"id": 1, "text": "one"}\n\n{"id": "two", "text": ""}\n'))
    pq.write_table(pa.table({"id": ["p0", "p1"], "text": ["zero", "one"]}), tmp_path / "t.parquet")
    corpus.put("table.parquet", (tmp_path / "t.parquet").read_bytes())
    corpus.put("saved/dataset_info.json", b"{}")
    corpus.put("saved/data-00000-of-00001.arrow", b"")
    corpus.put(".cache/x.txt", b"hidden")
    corpus.put("image.png", b"ignored")
    sources = list_sources(corpus.spec)
    assert [(s.kind, s.path) for s in sources] == [("text", "notes/a.md"), ("jsonl", "records.jsonl.gz"),
                                                   ("dataset", "saved"), ("parquet", "table.parquet")]
    docs = {d.source: d for s in sources for d in read_source(s)}
    assert docs["notes/a.md"].text == "A note." and docs["records.jsonl.gz#1"].doc_id == "1"
    assert "empty document" in docs["records.jsonl.gz#3"].error
    assert [docs[f"table.parquet#{i}"].text for i in (0, 1)] == ["zero", "one"]
    assert "copy the folder to local disk" in docs["saved"].error

    single = list_sources(uri(s3, "corpus-kinds/records.jsonl.gz"))
    assert [(s.kind, s.path) for s in single] == [("jsonl", "records.jsonl.gz")]
    assert [d.doc_id for d in read_source(single[0])] == ["1", "two"]
    with pytest.raises(SiftError, match="corpus not found: s3://sift/nothing-here"):
        list_sources(uri(s3, "nothing-here"))


# -------------------------------------------------------------------- a damaged index, a failing store (issue 32)


def test_unreadable_shard_is_profiled_again_on_s3(s3, built):
    """A listed shard whose bytes match the manifest but are not Parquet: the rebuild skips it, profiles exactly
    its documents again and says so; nothing is lost or duplicated (rows_by_id checks duplicates)."""
    corpus, index = copy_built(built, s3, "unreadable")
    store = Location.of(index)
    before = rows_by_id(index)
    manifest = json.loads(store.read_bytes(fmt.MANIFEST))
    bad = manifest["shards"][0]
    lost = set(pq.read_table(store.path(bad["path"]), filesystem=store.fs, columns=["doc_id"])["doc_id"].to_pylist())
    n_lost = bad["rows"]        # shards close at shard_rows = 2, or earlier when an idle actor takes what is gathered
    assert len(lost) == n_lost >= 1 and len(before) == 4
    damaged = b"these bytes are listed with their checksum but are not Parquet\n"
    store.put(bad["path"], damaged)
    bad.update(bytes=len(damaged), sha256=hashlib.sha256(damaged).hexdigest())
    store.put(fmt.MANIFEST, json.dumps(manifest).encode())

    stats = run_build(corpus, index, load_config(built[3]), echo=quiet)
    assert (stats.generation, stats.profiled, stats.reused, stats.deleted) == (2, n_lost, 4 - n_lost, 0)
    assert bad["path"] in stats.note and "not Parquet" in stats.note
    after = rows_by_id(index)
    assert set(after) == set(before)
    for doc_id, row in after.items():
        assert row["content_hash"] == before[doc_id]["content_hash"]
        if doc_id not in lost:  # reused byte for byte
            assert (row["la_bits"], row["ca_bits"]) == (before[doc_id]["la_bits"], before[doc_id]["ca_bits"])
    assert bad["path"] in fmt.load_manifest(store, fmt.MANIFEST).last_build["note"]


def _moto_auth(endpoint: str, count: str) -> None:
    """Make the moto server check credentials ("0": from now on) or accept anything ("inf")."""
    request = urllib.request.Request(f"http://{endpoint}/moto-api/reset-auth", data=count.encode(), method="POST",
                                     headers={"Content-Type": "text/plain"})
    urllib.request.urlopen(request, timeout=10).close()


def test_denied_credentials_and_unreachable_endpoint_are_one_line(s3, built):
    _, index, _, _ = built
    _moto_auth(s3, "0")  # the fake credentials in the environment are now refused
    try:
        with pytest.raises(SiftError, match="ACCESS_DENIED.*refused the credentials.*AWS_ACCESS_KEY_ID") as denied:
            SiftIndex.open(index, device="cpu")
        result = CliRunner().invoke(inspect_main, [index])
    finally:
        _moto_auth(s3, "inf")
    assert redact(index) in str(denied.value)
    assert result.exit_code == 2 and "refused the credentials" in result.stderr

    nobody = f"127.0.0.1:{_free_port()}"
    t0 = time.monotonic()
    with pytest.raises(SiftError, match=f"NETWORK_CONNECTION.*the store at {nobody} could not be reached") as down:
        SiftIndex.open(uri(nobody, "built/index"), device="cpu")
    assert "\n" not in str(down.value) and time.monotonic() - t0 < 60


def test_s3_timeouts_come_from_the_uri_with_defaults(s3):
    def options(location: Location) -> dict:
        return location.fs.__reduce__()[1][0]

    default = options(Location.of(uri(s3, "x")))
    assert (default["connect_timeout"], default["request_timeout"]) == (5.0, 5.0)
    given = Location.of(uri(s3, "x") + "&connect_timeout=2&request_timeout=30&max_attempts=5")
    assert (options(given)["connect_timeout"], options(given)["request_timeout"]) == (2.0, 30.0)
    assert options(given)["endpoint_override"] == s3 and given.uri.endswith("&max_attempts=5")
    for bad in ("request_timeout=0", "connect_timeout=soon", "max_attempts=2.5", "request_timeout=inf"):
        with pytest.raises(SiftError, match=f"{bad.split('=')[0]}=.* must be a .*number > 0"):
            Location.of(uri(s3, "x") + "&" + bad)
    with pytest.raises(SiftError, match="request_timeout in file:///tmp/x.* applies to s3:// URIs only"):
        Location.of("file:///tmp/x?request_timeout=3")


def test_frozen_store_mid_build_exits_2_in_bounded_time_naming_it(s3, ray_session, built, tmp_path):
    """The S3 server stops answering (SIGSTOP) while a build profiles: the build gives up after its request
    timeouts (the defaults: 5 s, 3 attempts per request) and names the store, instead of waiting minutes."""
    _, index = copy_built(built, s3, "frozen")
    make_corpus(tmp_path / "corpus", 4)
    for name in make_corpus(tmp_path / "more", 3, chars=300):
        (tmp_path / "corpus" / f"more-{name}").write_text((tmp_path / "more" / name).read_text())
    store = Location.of(index)
    before = set(store.files(fmt.SHARDS))
    server = SERVERS[s3].pid
    proc = subprocess.Popen([str(BIN / "sift-build"), str(tmp_path / "corpus"), "--out", index, "--config",
                             str(write_config(tmp_path / "c.toml", shard_rows=1)), "-q",
                             "--ray-address", ray_session.get_runtime_context().gcs_address],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    frozen = None
    try:
        deadline = time.time() + 300
        while frozen is None and proc.poll() is None and time.time() < deadline:
            if set(store.files(fmt.SHARDS)) - before:  # the actor is profiling: stop the store under it
                os.kill(server, signal.SIGSTOP)
                frozen = time.monotonic()
            time.sleep(0.2)
        assert frozen is not None, "the build wrote no shard in time"
        out, err = proc.communicate(timeout=300)
        waited = time.monotonic() - frozen
    finally:
        os.kill(server, signal.SIGCONT)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 2, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: cannot write "), err[-3000:]
    assert f"the store at {s3} could not be reached or did not answer" in lines[0]
    # One request of the actor and one of the driver (its lock), each at most 3 attempts of 5 s plus backoff,
    # then Ray's shutdown: a minute and a half is a generous bound (a build used to wait 213 s).
    assert waited < 90, waited
    assert IndexReader.open(index).generation == 1


def test_malformed_lease_is_taken_over_and_an_altered_write_named(s3, caplog):
    store = Location.of(uri(s3, "index-malformed-lease"))
    idx.prepare_dir(store)
    for record in (b'8E\r\n{"owner": "x"}\r\n0\r\n', b"[1, 2]", b'{"owner": "x", "host": "h", "pid": 7}',
                   json.dumps({"owner": "x", "host": "h", "pid": 0, "expires": time.time() + 600}).encode()):
        store.put(idx.LOCK, record)
        with idx.build_lock(store) as lease:  # a record that cannot be parsed guards nothing
            lease.check()
        assert not store.is_file(idx.LOCK)
    assert "malformed" in caplog.text

    _lock(store, expires=time.time() + 600, expires_utc="2026-12-02T17:56:17Z")
    with pytest.raises(SiftError, match=r"until 2026-12-02T17:56:17Z and renewed") as busy:
        with idx.build_lock(store):
            pass
    assert "UTC" not in str(busy.value)
    store.delete(idx.LOCK)

    # No credentials: pyarrow sends unsigned requests, whose bodies this server stores in their aws-chunked
    # framing, so the lock reads back as something else. The build says so, and leaves no lock behind.
    unsigned = pafs.S3FileSystem(anonymous=True, endpoint_override=s3, scheme="http")
    anonymous = Location(unsigned, f"{BUCKET}/index-malformed-lease", False, store.uri, store.spec)
    with pytest.raises(SiftError, match="does not read back as the lease this build wrote .*credentials"):
        with idx.build_lock(anonymous):
            pass
    assert not store.is_file(idx.LOCK)


def test_build_without_credentials_exits_2_naming_them(s3, tmp_path):
    make_corpus(tmp_path / "corpus", 1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "RAY_ADDRESS"}
    env.update(AWS_EC2_METADATA_DISABLED="true", AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
               AWS_CONFIG_FILE=str(tmp_path / "none"))
    index = uri(s3, "no-credentials")
    proc = subprocess.run([str(BIN / "sift-build"), str(tmp_path / "corpus"), "--out", index, "-q",
                           "--config", str(write_config(tmp_path / "c.toml"))],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert_one_line_failure(proc.stderr, "does not read back as the lease", "AWS_ACCESS_KEY_ID")
    assert "another sift-build" not in proc.stderr
    assert not Location.of(index).is_file(idx.LOCK)
