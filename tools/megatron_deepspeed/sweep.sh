#!/bin/bash
# The launches of docs/investigations/megatron-deepspeed.md, one at a time (a 2-core host), in the order given:
#   tools/megatron_deepspeed/sweep.sh s1 s2 s2p s3 t2 t3 bf16
# s1: stock + every schedule, 20 iterations, checkpoints at 10 and 20; s2: each resumed from its own iteration 10
# (auto without plan_file is refused by design); s2p: auto with plan_file, saved then resumed; s3: the stock
# checkpoint at 10 loaded under every schedule; t2, t3: more timing samples; bf16: stock, 1f1b, chimera, 6 iterations.
# Runs go to $MDS_SWEEP/runs (default /tmp/mds/inv), checkpoints to $MDS_SWEEP/ckpt, one line per launch to
# $MDS_SWEEP/summary.txt, with the count of /dev/shm/deepspeed_allreduce_buffer_* files left after it.
cd "$(dirname "$0")/../.." && O=${MDS_SWEEP:-/tmp/mds/inv} && mkdir -p $O
R=$O/runs; C=$O/ckpt; CF=tools/megatron_deepspeed/configs
mkdir -p $R $C
S=$O/summary.txt
tree() {  # what --chimera imports: a hash of the ds_chimera sources as they are now (the working tree can change)
  find ds_chimera -name '*.py' | sort | xargs cat | sha1sum | cut -c1-12
}
launch() {  # name, args...
  local name=$1; shift
  echo "=== $(date +%T) $name: $*  [ds_chimera sources $(tree)]" >> $S
  python3 tools/megatron_deepspeed/run.py --timeout 600 "$@" > $O/$name.out 2>&1
  local rc=$?
  echo "rc=$rc $(tail -1 $O/$name.out)  [ds_chimera sources after: $(tree)]" >> $S
  left=$(ls /dev/shm/deepspeed_allreduce_buffer_* 2>/dev/null | wc -l); echo "shm_left=$left" >> $S
}
for step in "$@"; do
case $step in
 s1)  # step 1 + step 2 first halves: 20 iterations, save at 10 and 20
  launch stock $CF/stock.json $R/stock --save $C/stock --save-interval 10
  for s in 1f1b chimera zbv interleaved breadth-first auto; do
    launch $s $CF/$s.json $R/$s --chimera --save $C/$s --save-interval 10
  done ;;
 s2)  # resume from own checkpoint at iteration 10
  launch stock_resume $CF/stock.json $R/stock_resume --load $C/stock -- --load-tag global_step10
  for s in 1f1b chimera zbv interleaved breadth-first auto; do
    launch ${s}_resume $CF/$s.json $R/${s}_resume --chimera --load $C/$s -- --load-tag global_step10
  done ;;
 s2p)  # auto with plan_file: save, then resume
  rm -f /tmp/mds/runs/auto_plan.json
  launch auto_planfile $CF/auto_planfile.json $R/auto_planfile --chimera --save $C/auto_planfile --save-interval 10
  cp /tmp/mds/runs/auto_plan.json $O/auto_plan.json
  launch auto_planfile_resume $CF/auto_planfile.json $R/auto_planfile_resume --chimera --load $C/auto_planfile -- --load-tag global_step10 ;;
 s3)  # stock checkpoint, loaded under each schedule
  for s in 1f1b chimera zbv interleaved breadth-first auto; do
    launch ${s}_fromstock $CF/$s.json $R/${s}_fromstock --chimera --load $C/stock -- --load-tag global_step10
  done ;;
 t2)  # timing repeats
  launch stock_t2 $CF/stock.json $R/stock_t2
  for s in 1f1b chimera zbv interleaved breadth-first auto; do
    launch ${s}_t2 $CF/$s.json $R/${s}_t2 --chimera
  done
  launch stock_t3 $CF/stock.json $R/stock_t3 ;;
 t3)  # third timing sample
  for s in 1f1b chimera zbv interleaved breadth-first auto; do
    launch ${s}_t3 $CF/$s.json $R/${s}_t3 --chimera
  done
  launch stock_t4 $CF/stock.json $R/stock_t4 ;;
 bf16)
  launch stock_bf16 $CF/stock.json $R/stock_bf16 --bf16 --iters 6
  for s in 1f1b chimera; do launch ${s}_bf16 $CF/$s.json $R/${s}_bf16 --chimera --bf16 --iters 6; done ;;
esac
done
echo "=== $(date +%T) done $*" >> $S
