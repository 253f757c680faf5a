"""The builder on a Ray cluster of two nodes: `ray start --head` and `ray start --address` on 127.0.0.1, each node
with its own CPUs and its own custom resource, `sift-build --ray-address` against them. Profiling runs on both
nodes (the build summary records which node profiled which shard) and the index equals one built on a single
node. Both nodes are stopped after the test whatever happens."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from sift.format import IndexReader

from .helpers import wiki_texts

BIN = Path(sys.executable).parent
RAY = [sys.executable, "-m", "ray.scripts.scripts"]  # the `ray` CLI of this interpreter
MARK = "SIFT_TEST_CLUSTER"  # in the environment of every process of the test's cluster, so all of them are found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_ports() -> list[str]:
    """Two nodes share one machine: every port a node listens on is its own."""
    flags = ["--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
             "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port"]
    return [arg for flag in flags for arg in (flag, str(_free_port()))]


def _processes_marked(mark: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and f"{MARK}={mark}".encode() in (entry / "environ").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _active_nodes(status: str) -> int:
    """The lines of `ray status`'s "Active:" block (one per node)."""
    lines = status.splitlines()
    if "Active:" not in lines:
        return 0
    count = 0
    for line in lines[lines.index("Active:") + 1:]:
        if not line.startswith(" "):
            break
        count += 1
    return count


class TwoNodes:
    """A head and a worker node started with `ray start --block` (each in its own session), stopped by `stop`:
    SIGTERM to each `ray start` (it stops what it started), and after 10 s SIGKILL to any process still carrying
    the cluster's mark."""

    def __init__(self, root: Path):
        self.mark = uuid.uuid4().hex
        # Token authentication, with a token of this cluster's own (not the user's ~/.ray one).
        self.env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
                        RAY_USAGE_STATS_ENABLED="0", **{MARK: self.mark})
        self.address = f"127.0.0.1:{_free_port()}"
        self.root = root
        self.procs: list[subprocess.Popen] = []

    def _start(self, name: str, args: list[str]) -> None:
        log = open(self.root / f"{name}.log", "w")
        self.procs.append(subprocess.Popen([*RAY, "start", "--block", "--node-ip-address", "127.0.0.1",
                                            "--disable-usage-stats", *args, *_node_ports()], env=self.env,
                                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def start(self) -> None:
        # Ray's sockets live under its temp dir, and a socket path may not exceed 107 bytes: a short one.
        self.temp = Path(tempfile.mkdtemp(prefix="sift-ray-", dir="/tmp"))
        temp = self.temp
        self._start("head", ["--head", "--port", self.address.rsplit(":", 1)[1], "--num-cpus", "2",
                             "--resources", json.dumps({"node_a": 1}), "--include-dashboard", "false",
                             "--ray-client-server-port", str(_free_port()), "--temp-dir", str(temp)])
        self._start("worker", ["--address", self.address, "--num-cpus", "2", "--resources", json.dumps({"node_b": 1})])
        self._wait_for(2)

    def _wait_for(self, nodes: int, timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            status = subprocess.run([*RAY, "status", "--address", self.address], env=self.env,
                                    capture_output=True, text=True, timeout=60)
            if status.returncode == 0 and _active_nodes(status.stdout) >= nodes:
                return
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(1)
        logs = "\n".join((self.root / f"{n}.log").read_text()[-1500:] for n in ("head", "worker")
                         if (self.root / f"{n}.log").exists())
        raise RuntimeError(f"the Ray cluster did not come up with {nodes} node(s):\n{logs}")

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.time() + 10
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for _ in range(10):  # whatever outlived its `ray start` (a worker, an agent): by the cluster's mark
            left = _processes_marked(self.mark)
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)
        if getattr(self, "temp", None):
            shutil.rmtree(self.temp, ignore_errors=True)


@pytest.fixture
def two_nodes(tmp_path):
    cluster = TwoNodes(tmp_path)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
    assert not _processes_marked(cluster.mark), "a process of the test's Ray cluster is still running"


def _build(corpus: Path, index: Path, config: Path, env: dict, *extra: str) -> dict:
    proc = subprocess.run([str(BIN / "sift-build"), str(corpus), "--out", str(index), "--config", str(config), "-q",
                           *extra], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return IndexReader.open(index).manifest.last_build


def test_build_on_two_nodes_equals_one_node(tmp_path, two_nodes):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(wiki_texts(4, step=23)):
        (corpus / f"doc{i}.txt").write_text(text[:200])
    config = tmp_path / "c.toml"
    config.write_text('model = "smollm2-135m-instruct"\n[profile]\ntile = 16\n[build]\nshard_rows = 1\n')

    spread = _build(corpus, tmp_path / "two", config, two_nodes.env, "--ray-address", two_nodes.address)
    nodes = spread["nodes"]
    assert len(nodes) == 2, nodes  # one actor per node, each profiled shards
    assert all(n["shards"] and n["documents"] for n in nodes.values()), nodes
    shards = [s for n in nodes.values() for s in n["shards"]]
    assert sorted(shards) == sorted(s.path for s in IndexReader.open(tmp_path / "two").manifest.shards)
    assert spread["profiled"] == 4 and sum(n["documents"] for n in nodes.values()) == 4

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    alone = _build(corpus, tmp_path / "one", config, env)
    assert len(alone["nodes"]) == 1
    rows = {}
    for name in ("two", "one"):
        table = IndexReader.open(tmp_path / name).table(["doc_id", "content_hash", "n_tokens", "la_bits", "ca_bits"])
        rows[name] = {r["doc_id"]: r for r in table.to_pylist()}
    assert rows["two"] == rows["one"]
