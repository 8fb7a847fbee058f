"""Tiny models and a single-process reference trainer for the multi-rank tests."""
import torch
from torch import nn

from deepspeed.pipe import LayerSpec, TiedLayerSpec

BASE_SEED = 1234
WIDTH = 8


class CountingTanh(nn.Tanh):
    """Tanh that counts its forward calls: recomputation under activation checkpointing shows up."""
    calls = 0

    def forward(self, x):
        CountingTanh.calls += 1
        return super().forward(x)


def mlp_specs(num_layers: int = 16, tied: bool = False):
    specs = []
    for i in range(num_layers):
        if tied and i in (0, num_layers - 1):
            specs.append(TiedLayerSpec("proj", nn.Linear, WIDTH, WIDTH))
        elif i % 2 == 1:
            specs.append(LayerSpec(CountingTanh))
        else:
            specs.append(LayerSpec(nn.Linear, WIDTH, WIDTH))
    return specs


def build_reference(specs):
    """Layers by global index, seeded exactly as the runtime and DeepSpeed's seed_layers seed them."""
    layers, tied = [], {}
    for idx, spec in enumerate(specs):
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in tied:
                torch.manual_seed(BASE_SEED + idx)
                tied[spec.key] = spec.build()
            layers.append(tied[spec.key])
        else:
            torch.manual_seed(BASE_SEED + idx)
            layers.append(spec.build())
    return layers


def reference_params(layers):
    seen, params = set(), []
    for layer in layers:
        for p in layer.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


def run_reference(layers, global_batches, steps, lr, clip):
    """Single-process training on the same global batches: mean loss, global-norm clipping, SGD."""
    params = reference_params(layers)
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9)
    losses, norms = [], []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        batches = global_batches(step)
        for x, y in batches:
            out = x
            for layer in layers:
                out = layer(out)
            loss = nn.functional.mse_loss(out, y) / len(batches)
            loss.backward()
            total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))))
        opt.step()
        losses.append(total)
    return losses, norms


def make_global_batches(num_micro_batches: int, micro_batch_size: int = 2):
    def batches(step):
        g = torch.Generator().manual_seed(100 + step)
        return [(torch.randn(micro_batch_size, WIDTH, generator=g),
                 torch.randn(micro_batch_size, WIDTH, generator=g) * 3) for _ in range(num_micro_batches)]
    return batches


def deepspeed_loss_scaler(fp16_section: dict):
    """DeepSpeed's own DynamicLossScaler, built from a DeepSpeed "fp16" config section: the oracle the
    scheduled engine's scale is held to."""
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
    return CreateLossScaler(torch.half, 0, True, {"init_scale": 2 ** fp16_section["initial_scale_power"],
                                                  "scale_window": fp16_section["loss_scale_window"],
                                                  "delayed_shift": fp16_section["hysteresis"],
                                                  "consecutive_hysteresis": False,
                                                  "min_scale": fp16_section["min_loss_scale"]})


def fp16_master_step(params, masters, optimizer, scale: float, clip: float) -> None:
    """The fp16 step one process runs as the references: unscale the fp16 gradients into the fp32 masters,
    clip there, step the masters and copy them back into the fp16 weights."""
    for p, m in zip(params, masters):
        m.grad = p.grad.float() / scale
    torch.nn.utils.clip_grad_norm_(masters, clip)
    optimizer.step()
    for p, m in zip(params, masters):
        p.data.copy_(m)
