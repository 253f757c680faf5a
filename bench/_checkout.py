"""Make `sift.*` importable from this checkout when the package is not installed (the GPU machine runs the
bench scripts straight from the repository): the folder mapping of pyproject.toml, `sift` -> common/,
`sift.kernels` -> kernels/, `sift.pipeline` -> pipeline/, `sift.runtime` -> runtime/. A no-op when installed."""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"sift": "common", "sift.kernels": "kernels", "sift.pipeline": "pipeline", "sift.runtime": "runtime"}


def _map(name: str, folder: str) -> None:
    spec = importlib.util.spec_from_file_location(name, ROOT / folder / "__init__.py",
                                                  submodule_search_locations=[str(ROOT / folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


class _Folders(importlib.abc.MetaPathFinder):
    """sift.pipeline / sift.runtime load from their folders when first imported (pipeline pulls in Ray)."""

    def find_spec(self, name, path=None, target=None):
        if name in FOLDERS and name not in ("sift", "sift.kernels"):
            return importlib.util.spec_from_file_location(name, ROOT / FOLDERS[name] / "__init__.py",
                                                          submodule_search_locations=[str(ROOT / FOLDERS[name])])
        return None


def use_checkout() -> None:
    try:
        import sift.kernels  # noqa: F401
    except ImportError:
        for name in ("sift", "sift.kernels"):
            sys.modules.pop(name, None)
        _map("sift", FOLDERS["sift"])
        _map("sift.kernels", FOLDERS["sift.kernels"])
        sys.meta_path.append(_Folders())


def load_file(path: str, name: str):
    """The Python module at `path` (e.g. a kernel file of an earlier commit, to time it next to this checkout's)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module   # registered first, as an import would (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module
