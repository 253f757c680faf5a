"""Constants shared by the kernels' softmax arithmetic.

The kernels exponentiate with exp2 (one MUFU instruction) rather than exp: scores are scaled by
`scale * LOG2E` once, so exp(s * scale) == exp2(s * scale * LOG2E), and a log-sum-exp in base 2 converts back
to natural log by dividing by LOG2E.
"""
import math

LOG2E = math.log2(math.e)
