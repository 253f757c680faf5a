"""Serving: the index as the runtime reads it (`SiftIndex`) and the engine that prefills and generates RAG
requests with SIFT's sparse, position-free attention over an unchanged transformers model (`SiftEngine`), and
the store that keeps documents' position-free KV across requests (`KVStore`)."""
from .engine import GenerateResult, PrefillResult, Request, SiftEngine
from .kv_store import KVStore
from .store import SiftIndex

__all__ = ["SiftIndex", "SiftEngine", "KVStore", "Request", "PrefillResult", "GenerateResult"]
