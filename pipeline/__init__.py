"""The builder: a corpus in, a SIFT index out (SPEC sections 1-3)."""
from .config import BuildConfig, ProfileConfig, load_config
from .corpus import SAMPLE_CORPUS, Source, SourceDoc, list_sources, read_source
from .job import BuildStats, run_build
from .profiler import Profiler

__all__ = ["BuildConfig", "ProfileConfig", "load_config", "SAMPLE_CORPUS", "Source", "SourceDoc", "list_sources",
           "read_source", "BuildStats", "run_build", "Profiler"]
