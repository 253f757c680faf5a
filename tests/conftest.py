"""Test-wide setup.

Without a GPU the Triton kernels run in the interpreter; it must be switched on before any kernel module
imports triton, so it is set here, at the top of the test session (an entrypoint), never at import time of
the library. tests/helpers.py `DEVICE` names where the kernel tests launch the kernels.

With a GPU, fp32 matrix products in torch are IEEE fp32, not TF32: a model forward or a reference computed on
the GPU then rounds as on the CPU, so the tolerances derived from eps(fp32) (tests/helpers.py) hold there too.
(The kernels choose IEEE `tl.dot` precision for fp32 inputs themselves; TF32's 10-bit mantissa would move
fp32 results by ~1e-3 of their magnitude, the size of the defects the tolerances are there to catch.)
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

torch.manual_seed(0)
