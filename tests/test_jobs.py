"""jobs/: every spec parses, every schedule is valid, and every command runs a real console script of this
project with options it accepts and config files that exist."""
from __future__ import annotations

import importlib
import inspect
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
JOBS = REPO / "jobs"
SCRIPTS: dict[str, str] = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def load_all(name: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all((JOBS / name).read_text()) if doc is not None]


def crontab_entries() -> list[tuple[list[str], str]]:
    """(five schedule fields, command) for each job line of jobs/crontab."""
    entries = []
    for line in (JOBS / "crontab").read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = line.split(None, 5)
        assert len(parts) == 6, f"crontab line needs 5 schedule fields and a command: {line!r}"
        entries.append((parts[:5], parts[5]))
    return entries


def commands() -> list[tuple[str, str]]:
    """(where, shell command) for every command in jobs/ that runs this project's CLI."""
    found = [("ray_job.yaml", load_all("ray_job.yaml")[0]["entrypoint"]),
             ("kuberay-rayjob.yaml", load_all("kuberay-rayjob.yaml")[0]["spec"]["entrypoint"])]
    found += [(f"crontab line {i}", cmd) for i, (_, cmd) in enumerate(crontab_entries(), start=1)]
    return found


def cli_invocations(command: str) -> list[tuple[str, list[str]]]:
    """(console script, its arguments) for each project script the shell command runs."""
    out, current = [], None
    for word in shlex.split(command):
        if word in {"&&", "||", ";", "|", ">", ">>", "2>&1"}:
            current = None
        elif Path(word).name in SCRIPTS:
            current = (Path(word).name, [])
            out.append(current)
        elif current is not None:
            current[1].append(word)
    return out


# ------------------------------------------------------------------------------------------------- parsing


@pytest.mark.parametrize("name", sorted(p.name for p in JOBS.glob("*.yaml")))
def test_every_yaml_parses(name):
    docs = load_all(name)
    assert docs and all(isinstance(d, dict) for d in docs)


def test_ray_job_spec_matches_the_submission_api():
    from ray.job_submission import JobSubmissionClient
    from ray.runtime_env import RuntimeEnv

    spec = load_all("ray_job.yaml")[0]
    accepted = set(inspect.signature(JobSubmissionClient.submit_job).parameters) - {"self"}
    assert set(spec) <= accepted, set(spec) - accepted
    assert set(spec["runtime_env"]) <= RuntimeEnv.known_fields
    assert spec["entrypoint_num_gpus"] == 0  # the driver does no profiling


def test_kuberay_rayjob_has_head_and_gpu_workers():
    [job] = load_all("kuberay-rayjob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    cluster = job["spec"]["rayClusterSpec"]
    import ray

    assert cluster["rayVersion"] == ray.__version__  # the image and the pinned Ray must agree
    assert cluster["headGroupSpec"]["template"]["spec"]["containers"]
    [workers] = cluster["workerGroupSpecs"]
    [container] = workers["template"]["spec"]["containers"]
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    yaml.safe_load(job["spec"]["runtimeEnvYAML"])


def test_cronjob_creates_the_rayjob_from_the_generated_configmap():
    docs = {d["kind"]: d for d in load_all("reindex-cronjob.yaml")}
    assert {"ServiceAccount", "Role", "RoleBinding", "CronJob"} <= set(docs)
    cron = docs["CronJob"]
    assert cron["apiVersion"] == "batch/v1" and cron["spec"]["concurrencyPolicy"] == "Forbid"
    check_schedule(cron["spec"]["schedule"].split())
    pod = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == docs["ServiceAccount"]["metadata"]["name"]
    [kustomization] = load_all("kustomization.yaml")
    assert kustomization["resources"] == ["reindex-cronjob.yaml"]
    [generator] = kustomization["configMapGenerator"]
    assert generator["files"] == ["kuberay-rayjob.yaml"]
    [volume] = [v for v in pod["volumes"] if "configMap" in v]
    assert volume["configMap"]["name"] == generator["name"]
    [container] = pod["containers"]
    [mount] = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    script = "\n".join(container["args"])
    assert f"kubectl create -f {mount['mountPath']}/kuberay-rayjob.yaml" in script
    rules = docs["Role"]["rules"]
    assert any("rayjobs" in r["resources"] and "create" in r["verbs"] for r in rules)


# ----------------------------------------------------------------------------------------------- schedules

_FIELD_RANGES = [(0, 59), (0, 23), (1, 31), (1, 12), (0, 7)]  # minute, hour, day of month, month, day of week


def check_schedule(fields: list[str]) -> None:
    assert len(fields) == 5, f"a cron schedule has 5 fields, got {fields}"
    for field, (low, high) in zip(fields, _FIELD_RANGES):
        for part in field.split(","):
            m = re.fullmatch(r"(\*|(\d+)(?:-(\d+))?)(?:/(\d+))?", part)
            assert m, f"bad cron field {field!r}"
            for number in (m.group(2), m.group(3)):
                assert number is None or low <= int(number) <= high, f"{field!r} out of range {low}-{high}"
            assert m.group(4) is None or int(m.group(4)) > 0


def test_crontab_lines_have_valid_schedules():
    entries = crontab_entries()
    assert entries
    for fields, _ in entries:
        check_schedule(fields)


def test_check_schedule_rejects_bad_fields():
    check_schedule("*/15 0-6,22 1 */2 1-5".split())
    for bad in ("60 * * * *", "* 24 * * *", "* * 0 * *", "* * * 13 *", "* * * * 8", "* * * *", "a * * * *"):
        with pytest.raises(AssertionError):
            check_schedule(bad.split())


# ---------------------------------------------------------------------------------------------- commands


@pytest.mark.parametrize("where,command", [pytest.param(w, c, id=w) for w, c in commands()])
def test_commands_run_project_scripts_with_existing_configs(where, command):
    calls = cli_invocations(command)
    assert calls, f"{where}: no console script of this project ({', '.join(SCRIPTS)}) in {command!r}"
    for script, args in calls:
        assert script == "sift-build" and "--out" in args, f"{where}: expected an incremental sift-build --out"
        configs = [args[i + 1] for i, arg in enumerate(args) if arg == "--config"]
        assert configs, f"{where}: pass --config explicitly so the schedule does not depend on defaults"
        for config in configs:
            assert (REPO / config).is_file(), f"{where}: config {config} does not exist in the repository"


def test_every_build_uses_the_same_config():
    configs = {args[args.index("--config") + 1] for _, cmd in commands() for _, args in cli_invocations(cmd)}
    assert configs == {"configs/default.toml"}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_console_scripts_are_importable(script):
    module_name, _, attr = SCRIPTS[script].partition(":")
    module = importlib.import_module(module_name)
    assert callable(getattr(module, attr)), f"{script} -> {SCRIPTS[script]} is not callable"


def test_commands_use_options_the_cli_accepts():
    import click

    for where, command in commands():
        for script, args in cli_invocations(command):
            module_name, _, attr = SCRIPTS[script].partition(":")
            cli = getattr(importlib.import_module(module_name), attr)
            assert isinstance(cli, click.Command), f"{SCRIPTS[script]} is expected to be a click command"
            accepted = {opt for param in cli.params for opt in param.opts}
            used = {arg for arg in args if arg.startswith("--")}
            assert used <= accepted, f"{where}: {script} does not accept {sorted(used - accepted)}"
