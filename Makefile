# One-command set-up and runs. torch is pinned: an unpinned install pulls a multi-GB CUDA build.
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
DEEPSPEED_VERSION ?= 0.19.8
MEGATRON_CORE_VERSION ?= 0.16.1
TRANSFORMERS_VERSION ?= 5.24.0
ACCELERATE_VERSION ?= 1.15.0
# the Triton the kernel tests (interpreter, sm_90 compiles) last passed with; the GPU run used 3.6.0
TRITON_VERSION ?= 3.9.0
STAMP := .make-installed

.PHONY: install test test-full demo demo-sim bench clean

$(STAMP): setup.py Makefile
	$(PYTHON) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PYTHON) -m pip install --quiet "deepspeed==$(DEEPSPEED_VERSION)" "triton==$(TRITON_VERSION)" pytest pytest-xdist matplotlib numpy
	$(PYTHON) -m pip install --quiet "megatron-core==$(MEGATRON_CORE_VERSION)" \
		"transformers==$(TRANSFORMERS_VERSION)" "accelerate==$(ACCELERATE_VERSION)"
	$(PYTHON) -m pip install --quiet --no-build-isolation --no-deps -e .
	# the native CPU kernels compile once per machine (about a minute); a multi-rank test's first step
	# would otherwise pay it inside its peers' timeout
	$(PYTHON) -c "from ds_chimera.ops import cpp_backend; cpp_backend.available()"
	touch $(STAMP)

install: $(STAMP)

# Two pytest workers, one test file each at a time: the multi-rank tests wait on each other's
# messages part of the time, and the second worker fills those gaps.
test: $(STAMP)
	$(PYTHON) -m pytest -q -n 2 --dist loadfile tests

# CI's suite plus the variants and grids it leaves out (about 15 minutes on the 2-core host): every shipped
# config, four more Megatron-contract cases, the whole interpreter kernel grids, 12 chaos cases, the two-node
# launch, a plain Trainer resuming a pipelined checkpoint, a caught kill, the pipeoptim launch, the whole
# bad-input grid (tests/test_bad_inputs.py: each bad file or key on 4 ranks).
test-full: $(STAMP)
	DS_CHIMERA_FULL=1 DS_CHIMERA_KERNEL_GRID=full DS_CHIMERA_CHAOS=12 $(PYTHON) -m pytest -q -n 2 --dist loadfile tests

# The main job: 4-rank CPU training of a small LM with Chimera, then the Gantt chart of that run.
demo: $(STAMP)
	rm -rf demo_out
	DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 $(PYTHON) -m ds_chimera.cli launch --num_gpus 4 \
		examples/train_pipeline.py --config configs/chimera.json --steps 60 --out demo_out

# Simulated comparison of every schedule (no training), charts in demo_out/sim/.
demo-sim: $(STAMP)
	$(PYTHON) examples/simulate_demo.py

bench: $(STAMP)
	$(PYTHON) benchmarks/simulator.py

clean:
	rm -rf $(STAMP) build *.egg-info demo_out
