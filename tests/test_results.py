"""Every committed benchmark result says where it comes from (bench/common.py `provenance`): the script and its
arguments, the commit and whether the tree differed from it, the date, the device and the software versions.
A result whose fields were added afterwards from git history says so (`provenance`); only there may the fields a
run did not record (the dirty flag, the transformers version) be null."""
import datetime
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "bench"))

from common import PROVENANCE_FIELDS  # noqa: E402  (bench/common.py)

VERSIONS = ("python", "torch", "triton", "transformers", "cuda")


def test_every_result_has_its_provenance():
    results = sorted(RESULTS.glob("*.json"))
    assert results, f"no results under {RESULTS}"
    problems = [f"{path.name}: {p}" for path in results for p in problems_of(json.loads(path.read_text()))]
    assert not problems, "results without their provenance (re-run the script, or delete the result and the " \
                         "figures quoting it):\n" + "\n".join(problems)


def problems_of(result: dict) -> list[str]:
    missing = [f for f in PROVENANCE_FIELDS if f not in result]
    if missing:
        return [f"missing {', '.join(missing)}"]
    backfilled = "provenance" in result
    out = []
    if not (ROOT / result["script"]).is_file():
        out.append(f"script {result['script']!r} is not a file of the repository")
    if not isinstance(result["args"], list):
        out.append("args is not the argv list")
    if not re.fullmatch(r"[0-9a-f]{40}", str(result["commit"])):
        out.append(f"commit {result['commit']!r} is not a commit id")
    if result["dirty"] is None and not backfilled or result["dirty"] not in (True, False, None):
        out.append(f"dirty {result['dirty']!r}")
    try:
        datetime.datetime.fromisoformat(result["date"])
    except (TypeError, ValueError):
        out.append(f"date {result['date']!r} is not an ISO date")
    device = result["device"]
    if not isinstance(device, dict) or not device.get("name") or "capability" not in device:
        out.append(f"device {device!r} lacks its name or capability")
    versions = result["versions"]
    if not isinstance(versions, dict) or any(k not in versions for k in VERSIONS):
        out.append(f"versions {versions!r} lacks one of {VERSIONS}")
    elif any(not versions[k] for k in ("python", "torch", "triton")) or (
            versions["transformers"] is None and not backfilled):
        out.append(f"versions {versions!r} has an empty entry")
    for name, entry in result.get("sets", {}).items():   # results that gather several runs: each names its own
        run = entry.get("run") or entry.get("settings") or {}
        if not run.get("command") or not re.fullmatch(r"[0-9a-f]{40}", str(run.get("commit"))):
            out.append(f"entry {name!r} lacks its command or commit")
    return out


@pytest.mark.parametrize("result, problem", [
    ({}, "missing"),
    (dict(script="bench/common.py", args=[], commit="unknown", dirty=False, date="2026-12-01T00:00:00+00:00",
          device=dict(name="GPU", capability="9.0"), versions=dict.fromkeys(VERSIONS, "1")), "commit"),
    (dict(script="bench/common.py", args=[], commit="0" * 40, dirty=None, date="2026-12-01T00:00:00+00:00",
          device=dict(name="GPU", capability="9.0"), versions=dict.fromkeys(VERSIONS, "1")), "dirty"),
    (dict(script="bench/common.py", args=[], commit="0" * 40, dirty=False, date="2026-12-01",
          device="NVIDIA H200", versions=dict.fromkeys(VERSIONS, "1")), "device"),
])
def test_a_result_without_provenance_is_named(result, problem):
    problems = problems_of(result)
    assert problems and any(problem in p for p in problems), problems


def test_a_fresh_result_passes(tmp_path, monkeypatch):
    """What `write_result` writes now carries every field: the commit of this checkout, or where the tree has no
    git, $SIFT_COMMIT."""
    import common

    monkeypatch.setenv("SIFT_COMMIT", "0" * 40)
    monkeypatch.setenv("SIFT_DIRTY", "0")
    path = common.write_result("probe", dict(value=1), tmp_path)
    result = json.loads(path.read_text())
    result["script"] = "bench/common.py"   # pytest's argv[0] is not a script of the repository
    assert problems_of(result) == [] and result["value"] == 1
