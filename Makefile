# lorakit — `make demo` and `make test` set everything up on a fresh machine.
#
#   make setup   virtual environment + torch + lorakit (editable, with dev and quant extras)
#   make demo    the whole path on tiny offline models (no downloads)
#   make demo-edit  the same for an edit family (Qwen-Image-Edit-Plus, two controls per item)
#   make test    the test suite (CPU; GPU tests run where a GPU is present)
#   make lint    ruff
#   make check-aarch64  the whole install resolves to binary wheels for a DGX Spark (aarch64, CPython 3.12)
#
# torch: the default pins are the pair tested on x86_64 (a CUDA 13.0 build that also runs on the CPU).
# Another build: make setup TORCH_SPEC="torch torchvision" TORCH_INDEX=https://download.pytorch.org/whl/cu130

PYTHON      ?= python3
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.14.1 torchvision==0.29.1
TORCH_INDEX ?=
BIN         := $(VENV)/bin
STAMP       := $(VENV)/.lorakit-installed
DEMO_OUT    ?= demo-out
PYTEST_ARGS ?=
# test workers: one per core, at most 4 (each holds torch + diffusers in memory); TEST_WORKERS=0 runs in-process
TEST_WORKERS ?= auto
XDIST       := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --maxprocesses=4 --dist worksteal)

.PHONY: setup demo demo-edit test test-fast lint check-aarch64 clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "installing torch ($(TORCH_SPEC)) and lorakit's dependencies into $(VENV): several GB, a few minutes"
	$(BIN)/python -c "import torch, torchvision" 2>/dev/null || \
	  $(BIN)/python -m pip install --progress-bar on $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) $(TORCH_SPEC)
	$(BIN)/python -m pip install --progress-bar on -e ".[dev,quant]"
	@echo "lorakit is $(BIN)/lorakit (source $(VENV)/bin/activate puts it on your PATH)"
	touch $(STAMP)

demo: setup
	$(BIN)/lorakit demo --out $(DEMO_OUT)

demo-edit: setup
	$(BIN)/lorakit demo --family qwen-image-edit-plus --out $(DEMO_OUT)-edit

test: setup
	$(BIN)/python -m pytest -q $(XDIST) $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest -q $(XDIST) -m "not slow" $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check lorakit tests scripts tools

check-aarch64: setup
	PYTHON=$(BIN)/python TORCH_SPEC="$(TORCH_SPEC)" bash scripts/check_aarch64_wheels.sh

clean:
	rm -rf $(DEMO_OUT) .pytest_cache .ruff_cache build *.egg-info
