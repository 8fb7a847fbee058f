#!/usr/bin/env bash
# One prepared check on one GPU (an H200), under 8 minutes, all output under one folder.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]            # on the GPU machine
#   bash benchmarks/gpu_check.sh --dry-run [OUT_DIR]  # here, on CPU: the same steps, tiny shapes,
#                                                     # Triton's interpreter; GPU-only steps say so
#
# Steps (each bounded by `timeout`, each logging to OUT_DIR/<step>.log):
#   1. install   this checkout into the machine's Python (no network: its torch and Triton stay)
#   2. env       GPU, driver, torch, Triton versions
#   3. correctness  Triton kernels against the fp64 reference within ops/error_bounds.py's bound,
#                forward, fused and single-gradient backward, decoding step; heads of 16-128
#                channels (wider than one 64-channel block), both layouts, fp32/bf16/fp16/fp64;
#                sharded over parallel processes (most of the time is compiling)
#   4. warm      the roofline cells run once each in parallel processes (fills Triton's cache)
#   5. roofline  forward/backward, LightConv/DynamicConv, fp32/bf16, K in 3 7 15 31 64 127,
#                centred and causal, in the layers' T x B x C (and B x C x T at K = 7, 31):
#                time and share of HBM bandwidth
#   6. runtime   benchmarks/gpu_runtime_check.py, one rank on NCCL: every synchronous schedule at D = 1
#                (tests/distributed/worker.py's equiv-1x1-* in fp32 and bf16-1x1-* against one-process
#                training), LocalPipeline training the DynamicConv LM on the GPU against plain training,
#                and one traced engine step (device-event clock, one trace event per compute action)
#   7. wavelet   benchmarks/gpu_wavelet_check.py, two processes on the one GPU: Wavelet's tick and tock
#                tasks (final weights = the staleness-1 recurrence), then the same model as two
#                gang-scheduled data-parallel tasks; per-device peak of allocated memory, Wavelet / gang
#                <= 0.8 (the dry run reports RSS instead, and no ratio)
# Time limits add up to 7 min 45 s (20 + 20 + 170 + 110 + 75 + 45 + 45); steps 6 and 7 stop their own
# workers a few seconds before their 45 s and report what finished. Each writes OUT_DIR/<step>/summary.txt
# and a JSON of every number, and exits 1 on a failed check, 3 on a check that could not run.
# The summary (OUT_DIR/summary.txt) lists each step's status, the roofline table and steps 6-7's summaries.
set -uo pipefail

DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=1; shift; fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/gpu_check_out/$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$OUT"
cd "$ROOT"
PY="${PYTHON:-python3}"
JOBS="${JOBS:-$(( $(nproc) > 14 ? 14 : $(nproc) ))}"
START=$(date +%s)
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"

if (( DRY_RUN )); then
  export TRITON_INTERPRET=1
  KFLAGS="--dry-run"
  JOBS=2
else
  unset TRITON_INTERPRET
  KFLAGS=""
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

note() { echo "$*" | tee -a "$SUMMARY"; }

# step NAME SECONDS CMD...: run CMD with a time limit, log it, record its status
step() {
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local status="ok"
  if (( rc == 124 )); then status="TIMED OUT after ${limit}s"; elif (( rc != 0 )); then status="FAILED (exit $rc)"; fi
  note "$(printf '%-12s %-28s %4ss  log: %s' "$name" "$status" "$(( $(date +%s) - t0 ))" "$OUT/$name.log")"
  return $rc
}

# sharded NAME SECONDS ARGS...: the kernels.py ARGS in $JOBS parallel shards, one log
sharded() {
  local name=$1 limit=$2; shift 2
  local pids=() rc=0
  for ((i = 0; i < JOBS; i++)); do
    timeout "$limit" "$PY" benchmarks/kernels.py "$@" --shard "$i/$JOBS" $KFLAGS \
      --out "$OUT/$name.$i.json" > "$OUT/$name.$i.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
  cat "$OUT/$name".*.log > "$OUT/$name.log"
  return $rc
}

note "gpu_check $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?') dry_run=$DRY_RUN jobs=$JOBS"

# 1. install (editable, no dependencies, no network); a dry run leaves this machine's environment alone
if (( DRY_RUN )); then
  note "install      skipped in a dry run (PYTHONPATH=$ROOT)"
else
  step install 20 "$PY" -m pip install --no-deps --no-build-isolation --no-index -e . || \
    note "install: continuing with PYTHONPATH=$ROOT"
fi

# 2. environment
step env 20 bash -c "nvidia-smi 2>&1 || echo 'nvidia-smi: none (no GPU here)'; \
  $PY -c 'import torch, triton; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \
\"triton\", triton.__version__, \"gpu\", torch.cuda.get_device_name() if torch.cuda.is_available() else None)'"

# 3. correctness (before any timing), sharded
t0=$(date +%s)
sharded correctness 170 --correctness
rc=$?
FAILS=$("$PY" benchmarks/kernels.py --summary "$OUT"/correctness.*.json 2>/dev/null)
note "$(printf '%-12s %-28s %4ss  log: %s' correctness "$([[ $rc == 0 ]] && echo ok || echo "FAILED/TIMEOUT (exit $rc)")" \
  "$(( $(date +%s) - t0 ))" "$OUT/correctness.log") ${FAILS:-}"

# 4. warm Triton's cache for the roofline, sharded; 5. time it in one process
t0=$(date +%s)
sharded warm 110 --roofline --warm
note "$(printf '%-12s %-28s %4ss' warm "exit $?" "$(( $(date +%s) - t0 ))")"
step roofline 75 "$PY" benchmarks/kernels.py --roofline $KFLAGS --out "$OUT/roofline.json"
if [[ -f "$OUT/roofline.json" ]]; then
  "$PY" benchmarks/kernels.py --table "$OUT/roofline.json" | tee -a "$SUMMARY"
fi

# 6. the runtime on CUDA: every synchronous schedule at D = 1 on the engine, LocalPipeline with the
#    DynamicConv LM on the device, a trace timed with device events (see the script's docstring)
if [[ -f benchmarks/gpu_runtime_check.py ]]; then
  step runtime 45 "$PY" benchmarks/gpu_runtime_check.py --out "$OUT/runtime" $( (( DRY_RUN )) && echo --dry-run )
  [[ -f "$OUT/runtime/summary.txt" ]] && sed 's/^/  /' "$OUT/runtime/summary.txt" >> "$SUMMARY"
else
  note "runtime      skipped: benchmarks/gpu_runtime_check.py not present"
fi

# 7. Wavelet's two tasks on one GPU: equality with the staleness-1 recurrence, and the peak memory per
#    device against two gang-scheduled tasks (see the script's docstring)
if [[ -f benchmarks/gpu_wavelet_check.py ]]; then
  step wavelet 45 "$PY" benchmarks/gpu_wavelet_check.py --out "$OUT/wavelet" $( (( DRY_RUN )) && echo --dry-run )
  [[ -f "$OUT/wavelet/summary.txt" ]] && sed 's/^/  /' "$OUT/wavelet/summary.txt" >> "$SUMMARY"
else
  note "wavelet      skipped: benchmarks/gpu_wavelet_check.py not present"
fi

note "total $(( $(date +%s) - START ))s; output in $OUT"
