"""Serving: the index as the runtime reads it (`SiftIndex`), the engine that prefills RAG requests with SIFT's
sparse, position-free attention over an unchanged transformers model and decodes them in continuous batches
(`SiftEngine`: `add_request` / `step` / `abort`, or `generate`), sampling (`SamplingParams`), and the store that
keeps documents' position-free KV across requests (`KVStore`)."""
from .engine import GenerateResult, PrefillResult, SiftEngine
from .kv_store import KVStore
from .request import Request, RequestOutput
from .sampling import SamplingParams
from .store import SiftIndex

__all__ = ["SiftIndex", "SiftEngine", "KVStore", "Request", "RequestOutput", "SamplingParams", "PrefillResult",
           "GenerateResult"]
