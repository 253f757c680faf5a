"""Test-wide setup.

Without a GPU the Triton kernels run in the interpreter; it must be switched on before any kernel module
imports triton, so it is set here, at the top of the test session (an entrypoint), never at import time of
the library.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.manual_seed(0)
