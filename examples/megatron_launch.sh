#!/usr/bin/env bash
# A Megatron-Core training launch on a ds_chimera schedule, on CPU (gloo) or GPUs (NCCL).
#
#   examples/megatron_launch.sh                      # chimera on 4 processes
#   SCHEDULE=zbv NPROC=4 examples/megatron_launch.sh --steps 50
#   SCHEDULE=interleaved OPTIONS='{"chunks": 2}' examples/megatron_launch.sh
#
# `ds-chimera launch --pipeline-schedule` makes Megatron-Core's own get_forward_backward_func()
# return the schedule in every worker; the training script does not name it. Extra arguments
# go to examples/megatron_gpt.py.
set -euo pipefail
cd "$(dirname "$0")/.."
SCHEDULE="${SCHEDULE:-chimera}"
NPROC="${NPROC:-4}"
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    export DS_ACCELERATOR=cpu OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
FLAGS=(--torchrun --pipeline-schedule "$SCHEDULE")
if [ -n "${OPTIONS:-}" ]; then
    FLAGS+=(--pipeline-schedule-options "$OPTIONS")
fi
exec "$PYTHON" -m ds_chimera.cli launch "${FLAGS[@]}" --nproc_per_node "$NPROC" \
    --master_port "${MASTER_PORT:-29517}" examples/megatron_gpt.py "$@"
