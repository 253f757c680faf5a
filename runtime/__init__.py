"""Serving: the index as the runtime reads it (`SiftIndex`) and the engine that prefills and generates RAG
requests with SIFT's sparse, position-free attention over an unchanged transformers model (`SiftEngine`)."""
from .engine import GenerateResult, PrefillResult, Request, SiftEngine
from .store import SiftIndex

__all__ = ["SiftIndex", "SiftEngine", "Request", "PrefillResult", "GenerateResult"]
