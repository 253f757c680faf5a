"""The builder: a corpus in, a SIFT index out (SPEC sections 1-3).

The names below are imported on first use, so `sift-build --help`, `sift-inspect` and the build's driver load
torch and transformers only where they need them."""
import importlib
import time

# When this process began importing the builder. In a profiling actor's process this is the moment its worker
# started loading the actor's code (torch, transformers, the profiler): `last_build.startup["actor_code"]`.
IMPORT_STARTED = time.time()

_EXPORTS = {"BuildConfig": "config", "ProfileConfig": "config", "load_config": "config", "SAMPLE_CORPUS": "corpus",
            "Source": "corpus", "SourceDoc": "corpus", "list_sources": "corpus", "read_source": "corpus",
            "BuildStats": "job", "run_build": "job", "Profiler": "profiler"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
