"""sift-serve on Ray Serve: `sift-serve INDEX --replicas 2` (a subprocess starting its own local Ray) with two CPU
engine replicas of the real SmolLM2 weights behind the FastAPI ingress, queried over HTTP on 127.0.0.1 with the
official `openai` client.

Document-affinity routing: a request goes to the replica whose KV store holds its documents, from the router's
record of what it sent where and, once that has expired, from the replicas' own reports. Greedy text through Ray
equals `SiftEngine.generate` (a reference engine in this process), bad input is a 400 carried back from the
replica, a disconnecting client is aborted in its replica, and SIGINT stops the server and every process of its
Ray cluster. Ray starts once for the module (it is slow to start).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sift.model import DEFAULT_MODEL, fingerprint, resolve_model_dir
from sift.runtime import KVStore, SiftEngine
from sift.runtime.server.routing import ROUTED_TTL_S

from .helpers import smollm2
from .test_engine import write_index
from .test_server import MAX_TOKENS, SYSTEM, Questions, chatml, free_port

START_TIMEOUT_S = 300


def _session_processes(sid: int) -> list[str]:
    """Processes of session `sid` still alive (the server and everything it started: Ray's daemons, its
    workers)."""
    out = subprocess.run(["ps", "-e", "-o", "sid=,pid=,stat=,comm="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines()
            if line.split()[0] == str(sid) and not line.split()[2].startswith("Z")]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model, tokenizer = smollm2()
    qs = Questions()
    ids = {d: tokenizer(t, add_special_tokens=False).input_ids for docs in qs.docs for d, t in docs}
    root = tmp_path_factory.mktemp("serve-ray")
    index = write_index(root / "index", model, fingerprint(resolve_model_dir(DEFAULT_MODEL)), ids, tile=16,
                        prefix_ids=[tokenizer.bos_token_id])
    ref = SiftEngine(model, tokenizer, index, kv_store=KVStore(hbm_bytes=64 << 20))
    reference = ref.generate([chatml(SYSTEM, qs.docs[0], qs.questions[0])], max_new_tokens=MAX_TOKENS, mode="reuse")
    del ref
    port = free_port()
    log = open(root / "sift-serve.log", "w")
    cmd = [str(Path(sys.executable).with_name("sift-serve")), str(index.path), "--replicas", "2", "--port",
           str(port), "--mode", "reuse", "--kv-hbm-gib", "0.0625", "--max-tokens-default", str(MAX_TOKENS)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, (root / "sift-serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "sift-serve did not become healthy"
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield dict(url=url, client=client, model=client.models.list().data[0].id, qs=qs, reference=reference,
                   proc=proc, log=root / "sift-serve.log")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def ask(cluster, i: int, **kw):
    qs = cluster["qs"]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": qs.questions[i]}]
    raw = cluster["client"].chat.completions.with_raw_response.create(
        model=cluster["model"], messages=messages, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"documents": qs.documents(i)}, **kw)
    return raw.headers["x-sift-replica"], raw.parse()


def test_greedy_through_ray_equals_engine_generate(cluster):
    replica, out = ask(cluster, 0)
    assert out.choices[0].message.content == cluster["reference"].texts[0]
    assert out.usage.completion_tokens == len(cluster["reference"].token_ids[0])


def test_affinity_sends_a_request_to_the_replica_holding_its_documents(cluster):
    """Question 0's documents are warm on one replica (the previous test); question 1's, cold everywhere, go
    to the other (the one holding fewer documents); then each goes back to its own replica: while the router's
    record of what it sent is fresh, and after it has expired, from the replicas' reports alone."""
    a, _ = ask(cluster, 0)
    b, _ = ask(cluster, 1)
    assert a != b
    for _ in range(2):
        assert ask(cluster, 1)[0] == b
        assert ask(cluster, 0)[0] == a
    time.sleep(ROUTED_TTL_S + 1.0)
    assert ask(cluster, 1)[0] == b
    assert ask(cluster, 0)[0] == a


def test_bad_input_through_ray_is_a_400(cluster):
    qs = cluster["qs"]
    body = dict(model=cluster["model"], messages=[{"role": "user", "content": qs.questions[0]}],
                documents=[{"id": "no such passage", "text": "Never indexed."}])
    r = httpx.post(cluster["url"] + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("documents", "document_not_found")


def test_disconnect_through_ray_aborts_in_the_replica(cluster):
    """A streaming client that hangs up is aborted in its replica: the replica counts it and holds nothing."""
    def replicas():
        text = httpx.get(cluster["url"] + "/metrics", timeout=30).text
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        out = {}
        for name in ("sift_requests_aborted", "sift_running_requests", "sift_queue_depth",
                     "sift_kv_store_pinned_entries"):
            for s in fams[name].samples:
                out.setdefault(s.labels["replica"], {})[name] = s.value
        return out

    before = replicas()
    qs = cluster["qs"]
    stream = cluster["client"].chat.completions.create(
        model=cluster["model"], messages=[{"role": "user", "content": qs.questions[2]}], max_tokens=64,
        temperature=0, stream=True, extra_body={"documents": qs.documents(2)})
    for n, _ in enumerate(stream):
        if n == 1:
            break
    stream.close()
    deadline = time.monotonic() + 60
    while True:
        now = replicas()
        aborted = sum(r["sift_requests_aborted"] for r in now.values()) - \
            sum(r["sift_requests_aborted"] for r in before.values())
        idle = all(r["sift_running_requests"] == r["sift_queue_depth"] == r["sift_kv_store_pinned_entries"] == 0
                   for r in now.values())
        if aborted == 1 and idle:
            break
        assert time.monotonic() < deadline, f"not aborted: {before} -> {now}"
        time.sleep(0.5)


def test_sigint_stops_the_server_and_its_ray(cluster):
    proc = cluster["proc"]
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 0, cluster["log"].read_text()[-3000:]
    deadline = time.monotonic() + 30
    while _session_processes(proc.pid):
        assert time.monotonic() < deadline, _session_processes(proc.pid)
        time.sleep(0.5)
