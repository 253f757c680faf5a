"""The README's Python blocks (and docs/building.md's) run as written, from the repository root, against the sample
index `make demo` builds.

The test builds that index from the sample corpus's documents the blocks name (profiled by the builder's own
`Profiler` on the real SmolLM2 weights, written by its own writers: the index `sift-build` writes, restricted to
those documents), puts it at `index/sample` of a scratch folder beside a link to `pipeline/sample_corpus`, and
executes every block of a file in order in one namespace, as a reader pasting them into one interpreter would. The
README's HTTP client block runs against `sift-serve index/sample --replicas 0`, started from that folder as the
README starts it (on a free port instead of 8000).
"""
import contextlib
import io
import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from sift.model import DEFAULT_MODEL, fingerprint, resolve_model_dir
from sift.pipeline import ProfileConfig, Profiler
from sift.pipeline.corpus import SAMPLE_CORPUS

from .helpers import smollm2
from .test_engine import write_index
from .test_server import free_port

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(path: Path, client: bool = False) -> list[str]:
    """The file's Python blocks: those that talk to a server (client=True) or the others."""
    return [b for b in FENCE.findall(path.read_text()) if ("OpenAI(" in b) == client]


def sample_documents(names: set[str]) -> dict[str, str]:
    """The sample corpus's JSONL records whose id is one of `names`: doc_id -> text."""
    docs = {}
    for path in sorted(SAMPLE_CORPUS.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["id"] in names:
                docs[record["id"]] = record["text"]
    return docs


@pytest.fixture(scope="module")
def sample_root(tmp_path_factory):
    """A folder with index/sample (the documents the README names) and pipeline/sample_corpus."""
    blocks = python_blocks(ROOT / "README.md") + python_blocks(ROOT / "README.md", client=True)
    quoted = {s for block in blocks for s in re.findall(r'"([^"\n]+)"', block)}
    docs = sample_documents(quoted)
    assert docs, "the README's quick start names no document of the sample corpus"
    model, tokenizer = smollm2()
    ids = {d: tokenizer(t, add_special_tokens=False).input_ids for d, t in docs.items()}
    cfg = ProfileConfig()
    profiler = Profiler(model, tokenizer, cfg, "torch")
    try:
        bits = {d: (b.la, b.ca) for d, b in ((d, profiler.profile(x)) for d, x in ids.items())}
    finally:
        model.set_attn_implementation("sdpa")
    root = tmp_path_factory.mktemp("readme")
    write_index(root / "index" / "sample", model, fingerprint(resolve_model_dir(DEFAULT_MODEL)), ids, tile=cfg.tile,
                bits=bits, prefix_ids=list(profiler.prefix_ids))
    (root / "pipeline").mkdir()
    (root / "pipeline" / "sample_corpus").symlink_to(SAMPLE_CORPUS, target_is_directory=True)
    return root


def run_blocks(path: Path, root: Path, monkeypatch, blocks: list[str] | None = None) -> str:
    blocks = python_blocks(path) if blocks is None else blocks
    assert blocks, f"{path} has no Python block"
    monkeypatch.chdir(root)
    namespace, out = {"__name__": "__main__"}, io.StringIO()
    with contextlib.redirect_stdout(out):
        for block in blocks:
            exec(compile(block, str(path), "exec"), namespace)
    print(out.getvalue())
    return out.getvalue()


def test_readme_is_a_guide():
    """At most 200 lines, and a serving quick start of at most 15."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    quick_start = [b for b in python_blocks(ROOT / "README.md") if "SiftEngine" in b]
    assert len(quick_start) == 1 and len(quick_start[0].splitlines()) <= 15


def test_readme_python_runs(sample_root, monkeypatch):
    """The quick start prints its answer and the tile fraction; the step-API block one finished request."""
    printed = run_blocks(ROOT / "README.md", sample_root, monkeypatch).strip().splitlines()
    assert len(printed) == 2, printed
    answer, _, fraction = printed[0].rpartition(" (")
    assert answer.strip(), printed
    assert re.fullmatch(r"\d+% of attention tiles computed\)", fraction), printed
    reason, _, text = printed[1].partition(" ")
    assert reason in ("stop", "length") and text.strip(), printed


def test_building_doc_python_runs(sample_root, monkeypatch):
    """docs/building.md reads the index with pyarrow and with DuckDB."""
    run_blocks(ROOT / "docs" / "building.md", sample_root, monkeypatch)


def test_readme_server_and_client_run(sample_root, monkeypatch):
    """The README's `sift-serve` command serves the sample index, and its `openai` client block prints an answer."""
    command = re.search(r"^\.venv/bin/(sift-serve [^#\n]*?)\s*(#|$)", (ROOT / "README.md").read_text(), re.M)
    assert command, "the README shows no sift-serve command"
    args = command.group(1).split()[1:]
    port = free_port()
    client = python_blocks(ROOT / "README.md", client=True)
    assert len(client) == 1 and "127.0.0.1:8000" in client[0]
    proc = subprocess.Popen([str(Path(sys.executable).with_name("sift-serve")), *args, "--port", str(port)],
                            cwd=sample_root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "sift-serve did not start"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.5)
        block = client[0].replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        printed = run_blocks(ROOT / "README.md", sample_root, monkeypatch, [block])
        assert printed.strip(), "the client block printed no answer"
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    assert rc == 0, proc.stdout.read()
