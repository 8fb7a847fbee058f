"""The gradient-sync strategies (ds_chimera.runtime.gradient_sync), each on its own.

The DeepSpeed runtime's families (test_runtime_deepspeed*.py) run them inside real engines; here each
strategy's contract is checked against a minimal host: what it posts, what it waits for, what it
divides by, which gradients a norm counts and a clip scales, and what it asks of DeepSpeed's ZeRO-1.
"""
import json
import types

import pytest
import torch
from torch import nn

from netutil import run_ranks

from ds_chimera.runtime.gradient_sync import (AllReduceSync, DeepSpeedZero1, GradientSource, ShardedSync, Zero1Sync,
                                              gradient_sync_for)


def _engine(zero: int = 0, bf16_groups=None, fp32_grads=None):
    optimizer = types.SimpleNamespace(bf16_groups=bf16_groups or [], fp32_groups_gradients=fp32_grads or [])
    return types.SimpleNamespace(using_bf16_optimizer=bf16_groups is not None, optimizer=optimizer,
                                 zero_optimization_stage=lambda: zero, module=nn.Linear(2, 2),
                                 grid=types.SimpleNamespace(get_pipe_parallel_group=lambda: "pipe-group"))


def _host(engine, groups_stage=None, zero1_reduce="chunk", dp=2):
    chunk = nn.Linear(3, 3)
    return types.SimpleNamespace(engine=engine, dp_size=dp, timeout_s=10.0, chunk_modules={0: chunk},
                                 stage_chunk={0: 0}, tied_modules={},
                                 groups=types.SimpleNamespace(stage=groups_stage or {}, tied={}),
                                 plan=types.SimpleNamespace(zero1_reduce=zero1_reduce),
                                 owned_params=lambda: list(chunk.parameters()))


def test_the_strategy_follows_the_configuration():
    host = _host(_engine())
    assert type(gradient_sync_for(host, host.engine, None)) is AllReduceSync
    assert type(gradient_sync_for(host, host.engine, shards=object())) is ShardedSync
    zero1 = _host(_engine(zero=1), zero1_reduce="end")
    zero1.engine.optimizer.bit16_groups = []
    chosen = gradient_sync_for(zero1, zero1.engine, None)
    assert type(chosen) is Zero1Sync and chosen.clips_itself and not chosen.reduce_each_chunk and chosen.divide_by == 1


def test_bf16_reads_and_scales_the_fp32_accumulators():
    lp = [nn.Parameter(torch.zeros(2, dtype=torch.bfloat16)), nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]
    hp = [torch.full((2,), 1.0), torch.full((3,), 2.0)]
    source = GradientSource(_engine(bf16_groups=[lp], fp32_grads=[hp]))
    assert source.bf16 and source.of(lp) == hp and source.counted(lp) == hp
    assert source.held(nn.Linear(1, 1)) == hp           # every accumulator, not the module's .grad
    assert source.to_sync(lp) == hp and all(p.grad is None for p in lp)     # bf16 grads are never created


def test_fp16_syncs_the_scaled_fp16_gradients_and_clips_the_unscaled_fp32_masters():
    from ds_chimera.runtime.fp16_masters import Fp16MasterOptimizer
    from ds_chimera.runtime.loss_scale import LossScale, LossScaleConfig
    layer = nn.Linear(2, 2)
    opt = Fp16MasterOptimizer(torch.optim.SGD(layer.parameters(), lr=0.1), LossScale(LossScaleConfig(loss_scale=8.0)),
                              modules=[layer])
    engine = _engine()
    engine.optimizer = opt
    source = GradientSource(engine, fp16=opt)
    params = list(layer.parameters())
    assert source.fp16 is opt and all(p.dtype == torch.float16 for p in params)
    for p in params:
        p.grad = torch.full_like(p, 4.0)                       # scaled by 8, in fp16
    assert source.to_sync(params) == [p.grad for p in params]   # the sync moves the fp16 gradients
    assert not opt.unscale(reduce=None)
    counted = source.counted(params)
    assert all(g.dtype == torch.float32 and float(g.flatten()[0]) == 0.5 for g in counted)    # 4 / 8
    assert source.held(layer) == counted
    for p in params:
        p.grad[0] = float("inf")
    assert opt.unscale(reduce=None) and opt.overflow
    before = [m.clone() for m in opt.param_groups[0]["params"]]
    opt.step()                                                  # skipped: the masters do not move
    assert all(torch.equal(a, b) for a, b in zip(before, opt.param_groups[0]["params"]))
    assert opt.loss_scale.skipped == 1 and opt.cur_scale == 8.0    # a static scale stays


def test_plain_gradients_are_created_for_a_sum_and_counted_as_they_are():
    params = [nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))]
    params[0].grad = torch.full((2,), 3.0)
    source = GradientSource(_engine())
    assert not source.bf16
    assert source.counted(params)[1] is None          # a norm skips a parameter that has no gradient
    synced = source.to_sync(params)
    assert params[1].grad is not None and synced[1] is params[1].grad and float(synced[1].sum()) == 0.0


def test_zero1_hands_a_chunk_to_zero_only_when_no_replica_sums_it_first():
    calls = []

    class Recorder:
        def start(self):
            calls.append("start")

        def reduce(self, params):
            calls.append(("reduce", len(list(params))))

        def finish(self):
            calls.append("finish")
    engine = _engine(zero=1)
    engine.optimizer.bit16_groups = []
    for replica_group, expected_early in ((None, 1), ("replicas", 0)):
        calls.clear()
        host = _host(engine, groups_stage={0: replica_group} if replica_group else {})
        sync = Zero1Sync(host, GradientSource(engine), reduce_each_chunk=True)
        sync.zero = Recorder()
        sync._post = lambda module, group, what: calls.append(("allreduce", group))
        sync.begin()
        sync.stage_done(0)
        sync.finish((0,))
        assert sync.early_chunks == expected_early
        posted = [("allreduce", replica_group)]
        assert calls == ["start"] + posted + ([("reduce", 2)] if replica_group is None else []) + ["finish"], calls


def test_zero1_adapter_reduces_each_parameter_once_and_ends_with_the_epilogue():
    p, q = nn.Parameter(torch.ones(1)), nn.Parameter(torch.ones(1))
    log = []
    opt = types.SimpleNamespace(
        bit16_groups=[[p, q]], contiguous_gradients=False, overlap_comm=False,
        set_gradient_accumulation_boundary=lambda flag: log.append(("boundary", flag)),
        get_gradient_for_reduction=lambda param: torch.ones(1),
        reduce_ready_partitions_and_remove_grads=lambda param, i: log.append(("reduce", param is p, i)),
        reduce_ipg_grads=lambda: log.append("flush"),
        overlapping_partition_gradients_reduce_epilogue=lambda: log.append("epilogue"))
    zero = DeepSpeedZero1(opt)
    zero.start()
    zero.reduce([p])
    zero.finish()
    reduced = [entry for entry in log if entry[0] == "reduce"]
    assert reduced == [("reduce", True, 0), ("reduce", False, 0)]      # p early, q at the end, each once
    assert log[-1] == "epilogue" and log.count("flush") == 1
    assert log[-2] == ("boundary", True)            # the epilogue runs at an accumulation boundary


def test_sharded_sync_delegates_to_the_chunk_shards():
    calls = []
    shards = types.SimpleNamespace(reduce_scatter=lambda c: calls.append(("rs", c)),
                                   finish_grads=lambda cs: calls.append(("finish", cs)),
                                   stepped=lambda: calls.append("stepped"),
                                   shard_params=[nn.Parameter(torch.ones(2))])
    shards.shard_params[0].grad = torch.full((2,), 2.0)
    host = _host(_engine(zero=3))
    sync = ShardedSync(host, shards)
    sync.begin()
    sync.stage_done(0)
    sync.finish((0,))
    sync.stepped()
    assert calls == [("rs", 0), ("finish", [0]), "stepped"]
    counted, held = sync.norm_grads()
    assert counted == held == [shards.shard_params[0].grad]
    assert sync.norm_group() is None and not sync.clips_itself


ALL_REDUCE = r"""
import json, sys, types
import torch, torch.distributed as dist
from torch import nn
from ds_chimera.runtime.gradient_sync import AllReduceSync, GradientSource
dist.init_process_group("gloo")
rank = dist.get_rank()
group = dist.new_group([0, 1])
chunk, tied = nn.Linear(2, 2), nn.Linear(1, 1)
for p in chunk.parameters():
    p.grad = torch.full_like(p, float(rank + 1))           # 1 on rank 0, 2 on rank 1
tied.weight.grad = torch.full_like(tied.weight, 10.0 * (rank + 1))     # tied.bias has no gradient yet
engine = types.SimpleNamespace(using_bf16_optimizer=False, optimizer=None, module=nn.ModuleList([chunk, tied]),
                               grid=types.SimpleNamespace(get_pipe_parallel_group=lambda: None))
host = types.SimpleNamespace(engine=engine, dp_size=int(sys.argv[2]), timeout_s=30.0, chunk_modules={0: chunk},
                             stage_chunk={0: 0}, tied_modules={"emb": tied},
                             groups=types.SimpleNamespace(stage={0: group}, tied={"emb": group}),
                             owned_params=lambda: list(chunk.parameters()))
sync = AllReduceSync(host, GradientSource(engine))
sync.begin()
sync.stage_done(0)
assert len(sync.pending) == 1                   # posted at SYNC_START; the tied weights wait for SYNC_WAIT
sync.finish((0,))
assert sync.pending == []
with open(f"{sys.argv[1]}.{rank}", "w") as fh:
    json.dump({"chunk": [float(p.grad.flatten()[0]) for p in chunk.parameters()],
               "tied_weight": float(tied.weight.grad.flatten()[0]), "tied_bias": float(tied.bias.grad[0])}, fh)
dist.destroy_process_group()     # gloo groups alive at exit can abort the process (runtime/teardown.py)
"""


@pytest.mark.parametrize("dp,expected", [(2, 1.5), (1, 3.0)])
def test_all_reduce_sums_the_holders_and_averages_over_data_parallelism(tmp_path, dp, expected):
    """Two ranks holding one stage: dp = 2 (two data-parallel copies) averages; dp = 1 (Chimera's two
    replicas of one pipeline) sums. Tied weights are synced at the wait, a missing gradient as zero."""
    script = tmp_path / "allreduce.py"
    script.write_text(ALL_REDUCE)
    out = tmp_path / "grads"
    results, _ = run_ranks([str(script), str(out), str(dp)], 2, {"OMP_NUM_THREADS": "1"}, timeout_s=120)
    for rank, (code, _, err) in enumerate(results):
        assert code == 0, (rank, err[-2000:])
        with open(f"{out}.{rank}") as fh:
            got = json.load(fh)
        assert got["chunk"] == [expected, expected]
        assert got["tied_weight"] == expected * 10 and got["tied_bias"] == 0.0
