#!/usr/bin/env bash
# Run one of DeepSpeed's pipeline test files, unchanged, in one of three modes (see sitecustomize.py).
#   tools/deepspeed_unit_tests/run.sh MODE[:SCHEDULE] TEST_FILE [pytest args...]
#   MODE: stock | import | schedule:NAME      TEST_FILE: relative to $DSU_TESTS (DeepSpeed's tests/ copy)
# Needs: DeepSpeed's tests/ files copied to $DSU_TESTS (default /tmp/ds_unit/tests), torchvision in
# $DSU_SITE (default /tmp/ds_unit/site; see README.md). One pytest process; the tests spawn the ranks.
set -u
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
spec=$1; shift; file=$1; shift
mode=${spec%%:*}; sched=${spec#*:}; [ "$sched" = "$spec" ] && sched=""
tests=${DSU_TESTS:-/tmp/ds_unit/tests}
logdir=${DSU_LOGDIR:-/tmp/ds_unit/logs}; mkdir -p "$logdir"
name=${DSU_NAME:-$(basename "$file" .py)}-${mode}${sched:+-$sched}
export DSU_MODE=$mode DSU_SCHEDULE=$sched DSU_LOG=$logdir/$name.engines
rm -f "$DSU_LOG"
export PYTHONPATH=$here:${DSU_SITE:-/tmp/ds_unit/site}:$repo
export DS_ACCELERATOR=cpu LOCAL_SIZE=${LOCAL_SIZE:-4} OMP_NUM_THREADS=1
export DS_UNITTEST_TIMEOUT=${DS_UNITTEST_TIMEOUT:-600}
cd "$tests" && python -m pytest -p no:cacheprovider -rA --tb=line "$file" "$@" 2>&1 | tee "$logdir/$name.log"
