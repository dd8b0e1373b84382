# Two commands: `make demo` and `make test`. Both create .venv on first use.
# TORCH picks the torch requirement; the default matches the CPU wheel on our machines,
# so a CPU-only machine does not pull a multi-GB CUDA build. Example: make test TORCH=torch==2.6.0
# PYTHON: the interpreter the venv is made from. The suite is mostly Python (Dynamo's and
# AOTAutograd's tracing): Debian's CPython 3.11, built with profile-guided and link-time
# optimisation, runs it in 0.8-0.9 of the CPU time of a pyenv build made without them
# (docs/measured.md, "The suite's Python"), so it is taken where it exists and can make a venv;
# python3 otherwise. Example: make test PYTHON=python3.12
PYTHON ?= $(firstword $(shell /usr/bin/python3.11 -c "import ensurepip, venv" 2>/dev/null \
	&& echo /usr/bin/python3.11) python3)
TORCH ?= torch==2.13.0
VENV ?= .venv
# tests/test_torchtitan.py runs torchtitan's own Llama3 and TP plan through FlashOverlap. Installed
# with --no-deps: torchtitan's declared dependencies pull a CUDA torch, triton, datasets and
# wandb, none of which the model and its parallelize code need. TORCHTITAN= skips it (the test
# then skips itself).
TORCHTITAN ?= torchtitan==0.3.0 spmd_types==0.2.3 tyro einops docstring-parser typeguard
STAMP := $(VENV)/.installed-$(subst /,_,$(subst =,_,$(subst >,_,$(subst <,_,$(TORCH)))))
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/.cache/inductor
# Two pytest workers, one test file each at a time (module fixtures stay in one process): much
# of the suite is single-threaded compilation, so two workers on two cores take about 0.6 of
# the time. PYTEST_ARGS= runs it in one process.
PYTEST_ARGS ?= -n 2 --dist loadfile

.PHONY: demo test clean

$(STAMP): pyproject.toml Makefile
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --upgrade pip
	$(VENV)/bin/python -m pip install "$(TORCH)"
	$(VENV)/bin/python -m pip install -e ".[test,lora,plot]" "$(TORCH)"
	$(if $(TORCHTITAN),$(VENV)/bin/python -m pip install --no-deps $(TORCHTITAN))
	rm -f $(VENV)/.installed-*
	touch $@

demo: $(STAMP)
	$(VENV)/bin/leancompile demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .cache build *.egg-info
