"""The builder: a corpus in, a SIFT index out (SPEC sections 1-3)."""
from .config import BuildConfig, ProfileConfig, load_config
from .corpus import SAMPLE_CORPUS, Source, SourceDoc, list_sources, read_source
from .index import IndexReader
from .job import BuildStats, run_build
from .model import DEFAULT_MODEL, ModelIdentity, load_model
from .profiler import Profiler, content_hash

__all__ = ["BuildConfig", "ProfileConfig", "load_config", "SAMPLE_CORPUS", "Source", "SourceDoc", "list_sources",
           "read_source", "IndexReader", "BuildStats", "run_build", "DEFAULT_MODEL", "ModelIdentity", "load_model",
           "Profiler", "content_hash"]
