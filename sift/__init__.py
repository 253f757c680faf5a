"""SIFT: an offline LA/CA attention-bit index for RAG corpora (`sift.pipeline`), its Triton kernels
(`sift.kernels`) and a sparse, position-free prefill runtime for transformers models (`sift.runtime`)."""
from .errors import SiftError

__all__ = ["SiftError"]
