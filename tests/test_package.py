"""The package's shape: serving code never loads the builder nor the research tools, and every import name leads
to its file.

The stages live in top-level folders (pipeline/, kernels/, runtime/, quality/) mapped to `sift.<stage>`; the root
package is the folder sift/. Inside the stages a sibling stage is imported relatively (`from ..kernels import
x`, which resolves to the same file by module name and by path) and a root module absolutely
(`from sift.format import x`, the folder sift/). An absolute `sift.kernels...` import inside the package would
name a path that does not exist (sift/kernels/).
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("pipeline", "kernels", "runtime", "quality")
ROOT_MODULES = {p.stem for p in (ROOT / "sift").glob("*.py")} - {"__init__"}


def _imports(path: Path):
    """-> [(module name as written, level)] of every import statement in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            yield node.module or "", node.level, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, 0, node.lineno


def _package_files():
    for folder in STAGES + ("sift", "runtime/server"):
        yield from sorted((ROOT / folder).glob("*.py"))


def test_import_sift_runtime_loads_neither_ray_nor_the_builder_nor_the_research_tools_nor_the_server():
    code = ("import sys, sift.runtime\n"
            "names = ('ray', 'sift.pipeline', 'sift.quality', 'sift.runtime.server', 'fastapi', 'uvicorn',\n"
            "         'prometheus_client')\n"
            "bad = sorted(m for m in sys.modules if m in names or m.startswith(tuple(n + '.' for n in names)))\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_the_build_commands_start_without_torch_transformers_or_ray():
    """`sift-build --help` and `sift-inspect` import neither; the build's driver module imports neither either,
    so Ray starts (and the plan runs beside it) without waiting for them."""
    code = ("import sys, sift.pipeline.cli, sift.pipeline.job\n"
            "names = ('torch', 'transformers', 'ray', 'triton')\n"
            "print(sorted(m for m in sys.modules if m in names))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


@pytest.mark.parametrize("path", list(_package_files()), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_import_names_lead_to_files(path):
    parts = path.parent.relative_to(ROOT).parts      # ("runtime",) or ("runtime", "server")
    folder = parts[0]
    for module, level, line in _imports(path):
        where = f"{path.relative_to(ROOT)}:{line}"
        if level == 0 and module.startswith("sift."):
            top = module.split(".")[1]
            assert top in ROOT_MODULES, (f"{where}: absolute import of {module!r}; import a stage relatively "
                                         f"(from ..{top} import ...) so the name leads to {top}/")
        if folder == "runtime":
            for stage, what in (("pipeline", "the builder"), ("quality", "the research tools")):
                assert not (level == len(parts) + 1 and module.split(".")[0] == stage), (
                    f"{where}: runtime/ imports {what}")
                assert not module.startswith(f"sift.{stage}"), f"{where}: runtime/ imports {what}"
        if level == len(parts) + 1:
            target = module.split(".")[0]
            assert folder in STAGES and (ROOT / target).is_dir() and target in STAGES, (
                f"{where}: relative import {'.' * level}{module} does not name a stage folder")
        elif 2 <= level <= len(parts):     # a module of an enclosing package: its file must be there
            base = ROOT.joinpath(*parts[:len(parts) - level + 1], *module.split(".")[:1])
            assert base.with_suffix(".py").is_file() or base.is_dir(), (
                f"{where}: relative import {'.' * level}{module} names no file")


def test_the_index_format_has_one_home():
    """pipeline/ and runtime/ both read the format from sift.format (the spec's schemas live there once)."""
    for stage in ("pipeline", "runtime"):
        names = {m for p in (ROOT / stage).glob("*.py") for m, level, _ in _imports(p) if level == 0}
        assert "sift.format" in names, f"{stage}/ does not import sift.format"
    assert (ROOT / "docs" / "SPEC.md").is_file()
