"""The typed pipeline configuration: parsed once per entry point, immutable, checked before any work."""
import dataclasses
import os
import subprocess
import sys

import pytest

from netutil import free_port
from ds_chimera.config import BatchSizes, PipelineConfig

BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8}


def parse(section, **config):
    return PipelineConfig.from_deepspeed({**BASE, "pipeline": section, **config})


def test_a_deepspeed_config_becomes_one_typed_value(tmp_path):
    cfg = parse({"schedule": "chimera", "pipelines": 1, "timeout": 30, "trace_dir": str(tmp_path / "t"),
                 "partition_method": "uniform", "activation_checkpoint_interval": 1},
                gradient_clipping=1.5, zero_optimization={"stage": 0}, bf16={"enabled": True})
    assert (cfg.schedule, dict(cfg.options), cfg.timeout_s) == ("chimera", {"pipelines": 1}, 30.0)
    assert (cfg.trace_dir, cfg.partition_method, cfg.activation_checkpoint_interval) == \
        (str(tmp_path / "t"), "uniform", 1)
    assert (cfg.clip, cfg.precision, cfg.bf16, cfg.zero_stage, cfg.sharded) == (1.5, "bf16", True, 0, False)
    assert cfg.batch == BatchSizes(None, 2, 8) and cfg.batch.micro_batches(4) == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.timeout_s = 1.0
    with pytest.raises(TypeError):
        cfg.options["pipelines"] = 2          # the options are read-only too
    assert cfg.with_clip(float("inf")).clip == float("inf") and cfg.clip == 1.5


def test_defaults_are_deepspeeds():
    cfg = parse({"schedule": "1f1b"})
    assert (cfg.timeout_s, cfg.trace_dir, cfg.partition_method, cfg.activation_checkpoint_interval) == \
        (300.0, None, None, None)
    assert (cfg.zero_stage, cfg.zero1_reduce, cfg.reshard_after_forward, cfg.clip, cfg.precision) == \
        (0, "chunk", True, 0.0, "fp32")


def test_micro_batches_are_derived_as_deepspeed_does():
    assert BatchSizes(16, 2, None).micro_batches(2) == 4
    assert BatchSizes(None, None, None).micro_batches(2) == 1
    with pytest.raises(ValueError, match="train_batch_size 10 is not divisible by train_micro_batch_size_per_gpu 4"):
        BatchSizes(10, 4, None).micro_batches(1)
    cfg = PipelineConfig.from_deepspeed({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
                                         "gradient_accumulation_steps": 4, "pipeline": {"schedule": "1f1b"}})
    assert cfg.batch == BatchSizes(None, 2, 4)


@pytest.mark.parametrize("section,extra,message", [
    ({"schedule": "1f1b"}, {"gradient_clipping": -1}, "gradient_clipping must be a number >= 0 (0: no clipping), got -1"),
    ({"schedule": "1f1b"}, {"gradient_clipping": "auto"}, "gradient_clipping must be a number >= 0"),
    ({"schedule": "1f1b", "partition_method": "even"}, {},
     "partition_method must be one of parameters, uniform, type:REGEX; got 'even'"),
    ({"schedule": "1f1b", "activation_checkpoint_interval": -1}, {}, "activation_checkpoint_interval must be >= 0"),
    ({"schedule": "1f1b", "stages": 0}, {}, '"pipeline": stages must be >= 1, got 0'),
    ({"schedule": "1f1b"}, {"gradient_accumulation_steps": 2.5}, "gradient_accumulation_steps must be an integer"),
    ({"schedule": "1f1b"}, {"zero_optimization": {"stage": 4}}, 'must be 0, 1, 2 or 3; got 4'),
    ({"schedule": "1f1b"}, {"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}},
     "fp16 with ZeRO stage 2 is not supported by ds_chimera schedules yet: use ZeRO stage 0 or 1 with fp16"),
    ({"schedule": "1f1b"}, {"fp16": {"enabled": True}, "bf16": {"enabled": True}}, '"fp16" and "bf16" are both enabled'),
    ({"schedule": "1f1b"}, {"fp16": {"enabled": True, "loss_scale_window": 0}}, '"fp16": loss_scale_window must be >= 1'),
    ({"schedule": "1f1b"}, {"torch_autocast": {"enabled": True, "dtype": "torch.float16"}},
     '"torch_autocast" with float16 is not supported'),
    ({"schedule": "1f1b"}, {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}},
     "ZeRO stage 3 with pipeline schedules shards fp32 weights"),
    ({"schedule": "1f1b", "reshard_after_forward": False}, {}, "applies to ZeRO stage 3 only"),
    ({"schedule": "1f1b", "zero1_reduce": "later"}, {}, "zero1_reduce must be one of chunk, end; got 'later'"),
    ({"schedule": "chimaera"}, {}, "unknown schedule 'chimaera'. Did you mean 'chimera'? Available: 1f1b,"),
])
def test_bad_values_are_refused_by_the_parser(section, extra, message):
    with pytest.raises(ValueError) as err:
        parse(section, **extra)
    assert message in str(err.value)


def test_placement_dependent_limits_are_checked_with_the_schedule():
    # ZeRO-1 takes Chimera's replicas (its norm skips the copies, runtime/host.py); ZeRO-2/3 cannot
    assert parse({"schedule": "chimera"}, zero_optimization={"stage": 1}).build_schedule(4, 8).name == "chimera"
    with pytest.raises(ValueError, match="ZeRO stage 2 with schedule 'chimera': its stages are replicated"):
        parse({"schedule": "chimera"}, zero_optimization={"stage": 2}).build_schedule(4, 8)
    with pytest.raises(ValueError, match="ZeRO stage 3 with schedule 'pipeoptim': an asynchronous schedule"):
        parse({"schedule": "pipeoptim"}, zero_optimization={"stage": 3}).build_schedule(4, 8)
    with pytest.raises(ValueError, match="interleaved needs micro_batches to be a multiple of stages"):
        parse({"schedule": "interleaved"}).build_schedule(4, 6)
    assert parse({"schedule": "zbv"}, zero_optimization={"stage": 3}).build_schedule(4, 8).name == "zbv"


def test_the_hf_path_refuses_sharding():
    with pytest.raises(ValueError, match="ZeRO stage 2 with pipeline schedules runs on ds_chimera's DeepSpeed engine"):
        PipelineConfig.from_deepspeed({**BASE, "pipeline": {"schedule": "1f1b"}, "zero_optimization": {"stage": 2}},
                                      sharding=False)


def test_megatron_arguments_parse_to_the_same_type():
    cfg = PipelineConfig.from_megatron("interleaved", {"chunks": 2, "timeout": 12})
    assert (cfg.schedule, dict(cfg.options), cfg.timeout_s) == ("interleaved", {"chunks": 2}, 12.0)
    assert dict(PipelineConfig.from_megatron("interleaved", {}).with_default_option("chunks", 3).options) == \
        {"chunks": 3}
    assert dict(cfg.with_default_option("chunks", 3).options) == {"chunks": 2}       # the user's own stays
    assert dict(PipelineConfig.from_megatron("1f1b", {}).with_default_option("chunks", 3).options) == {}
    with pytest.raises(ValueError, match="get_forward_backward_func: timeout must be a finite number of seconds > 0"):
        PipelineConfig.from_megatron("1f1b", {"timeout": 0})
    with pytest.raises(ValueError, match="schedule 'pipeoptim' is asynchronous"):
        PipelineConfig.from_megatron("pipeoptim", {})
    with pytest.raises(ValueError, match="schedule '1f1b' has no option 'chunks'"):
        PipelineConfig.from_megatron("1f1b", {"chunks": 2})


PARSED_ONCE = r'''
import os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                  DS_ACCELERATOR="cpu")
import torch, deepspeed
import ds_chimera
from ds_chimera import config as cfgmod
from ds_chimera.runtime import plan as planmod, setup as setupmod
from deepspeed.pipe import LayerSpec, PipelineModule

calls, parsed = [], []
parse = cfgmod.PipelineConfig.from_deepspeed.__func__
def counted(cls, config, **kw):
    calls.append("parse")
    result = parse(cls, config, **kw)
    parsed.append(True)
    return result
cfgmod.PipelineConfig.from_deepspeed = classmethod(counted)

class Watched(dict):
    """The user's config: once parsed, nothing below the entry point may read its "pipeline" section again."""
    def _read(self, key):
        if key == "pipeline" and parsed:
            raise AssertionError("the raw config's pipeline section was read again after parsing")
    def get(self, key, default=None):
        self._read(key)
        return super().get(key, default)
    def __getitem__(self, key):
        self._read(key)
        return super().__getitem__(key)

make_plan, prepare = planmod.make_plan, setupmod.prepare_module
def checked_make_plan(config, *args):
    assert isinstance(config, cfgmod.PipelineConfig), type(config)
    calls.append("make_plan")
    return make_plan(config, *args)
def checked_prepare(module, config, *rest):
    assert isinstance(config, cfgmod.PipelineConfig), type(config)
    calls.append("prepare_module")
    return prepare(module, config, *rest)
setupmod.make_plan, setupmod.prepare_module = checked_make_plan, checked_prepare

deepspeed.init_distributed(dist_backend="gloo")
net = PipelineModule(layers=[LayerSpec(torch.nn.Linear, 4, 4) for _ in range(2)], num_stages=1,
                     loss_fn=torch.nn.MSELoss())
config = Watched({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                  "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                  "pipeline": {"schedule": "1f1b", "timeout": 60}})
engine, *_ = deepspeed.initialize(model=net, config=config, model_parameters=net.parameters())
assert engine.plan.config.timeout_s == 60.0, engine.plan.config
loss = engine.train_batch(iter([(torch.randn(2, 4), torch.randn(2, 4)) for _ in range(2)]))
assert torch.isfinite(loss)
assert engine.get_global_grad_norm() is None     # unclipped fp32: no norm, as DeepSpeed's stock engine
print("CALLS", calls)
'''


def test_initialize_parses_the_config_once_and_passes_the_typed_value_down(tmp_path):
    script = tmp_path / "parsed_once.py"
    script.write_text(PARSED_ONCE)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, str(script), str(free_port())], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    calls = [line for line in proc.stdout.splitlines() if line.startswith("CALLS")]
    assert calls == ["CALLS ['parse', 'prepare_module', 'make_plan']"], proc.stdout[-2000:]


@pytest.mark.parametrize("extra,norm", [
    ({}, False),                                                  # unclipped fp32: no norm, as the stock engine
    ({"gradient_clipping": 1.0}, True),                           # to clip
    ({"bf16": {"enabled": True}}, True),                          # BF16_Optimizer reports it every step
    ({"gradient_clipping": 1.0, "zero_optimization": {"stage": 1}}, False),   # ZeRO-1 clips inside its step
    ({"gradient_clipping": 1.0, "zero_optimization": {"stage": 3}}, True),
])
def test_the_step_meets_for_a_global_norm_only_where_one_is_used(extra, norm):
    from ds_chimera.runtime.plan import make_plan
    from ds_chimera.schedules.actions import Clip, ClipScope
    from ds_chimera.sim import simulate
    cfg = parse({"schedule": "zbv"}, **extra)
    assert cfg.global_norm is norm
    plan = make_plan(cfg, 4, 1, 16, lambda stages, method: [2 * i for i in range(stages + 1)])
    clips = [op for ops in plan.program.ops for op in ops if type(op) is Clip and op.scope == ClipScope.GLOBAL]
    assert len(clips) == (4 if norm else 0)
    assert simulate(plan.program).valid
