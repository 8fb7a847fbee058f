# One-command set-up and runs. torch is pinned: an unpinned install pulls a multi-GB CUDA build.
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
DEEPSPEED_VERSION ?= 0.19.8
STAMP := .make-installed

.PHONY: install test demo bench clean

$(STAMP): setup.py Makefile
	$(PYTHON) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PYTHON) -m pip install --quiet "deepspeed==$(DEEPSPEED_VERSION)" pytest matplotlib numpy
	$(PYTHON) -m pip install --quiet --no-build-isolation --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PYTHON) -m pytest -q tests

demo: $(STAMP)
	$(PYTHON) examples/simulate_demo.py

bench: $(STAMP)
	$(PYTHON) benchmarks/simulator.py

clean:
	rm -rf $(STAMP) build *.egg-info demo_out
