"""Run a schedule's per-rank orders in one process, on real modules and optimizers.

Each rank's state (its stage's weights, optimizer and weight versions) changes only by its
own actions, in its own order, so any interleaving that respects the data dependencies
gives the same numbers as the distributed runtime. That makes this the reference the
multi-rank tests compare the asynchronous engine against, and the engine of the
convergence study (``benchmarks/pipeoptim_convergence.py``), where D ranks on two cores
would measure the CPU rather than the method.
"""
from __future__ import annotations

import torch

from . import executor
from ..optim.predictors import predictor_for
from ..optim.versions import WeightVersions
from ..schedules.actions import BACKWARD, FORWARD, STEP
from ..schedules.base import Schedule


class LocalPipeline:
    """``stages[k]`` is stage k's module and ``optimizers[k]`` its optimizer (one chunk per rank)."""

    def __init__(self, schedule: Schedule, stages: list, optimizers: list, loss_fn, clip: float = 0.0):
        if schedule.placement.num_replicas != 1 or len(schedule.placement.chunks) != schedule.stages:
            raise ValueError(f"LocalPipeline runs single-route, one-chunk-per-rank schedules; {schedule.name!r} "
                             f"has {len(schedule.placement.chunks)} chunks on {schedule.stages} ranks")
        if len(stages) != schedule.stages or len(optimizers) != schedule.stages:
            raise ValueError(f"need {schedule.stages} stage modules and optimizers, got {len(stages)} and "
                             f"{len(optimizers)}")
        self.schedule, self.stages, self.optimizers, self.loss_fn = schedule, stages, optimizers, loss_fn
        self.clip = clip
        policy = getattr(schedule, "weight_policy", "live") if not schedule.synchronous else "live"
        self.predictors = [None] * schedule.stages
        if policy == "predict":
            self.predictors = [predictor_for(schedule, o) for o in optimizers]
        self.versions = [WeightVersions(m, policy, p) for m, p in zip(stages, self.predictors)]
        self.gaps = {key: schedule.steps_ahead(*key) for key in schedule.versions()} if policy == "predict" else {}
        self.scale = 1.0 / (schedule.update_interval() if not schedule.synchronous else schedule.micro_batches)
        self.record = False

    def _step(self, k: int) -> None:
        params = [p for p in self.stages[k].parameters() if p.grad is not None]
        if self.clip > 0 and params:
            torch.nn.utils.clip_grad_norm_(params, self.clip)
        if self.predictors[k] is not None:
            self.predictors[k].before_step()
        self.optimizers[k].step()
        if self.predictors[k] is not None:
            self.predictors[k].after_step()
        self.optimizers[k].zero_grad(set_to_none=True)
        self.versions[k].step_done()

    def train_batch(self, batches: list) -> float:
        """Run one call's orders on ``batches`` (one (x, y) per micro-batch); the mean loss."""
        sched, last = self.schedule, self.schedule.stages - 1
        orders = [list(o) for o in sched.orders]
        pcs = [0] * len(orders)
        acts, grads, leaves, outs, losses = {}, {}, {}, {}, []
        while any(pc < len(o) for pc, o in zip(pcs, orders)):
            progressed = False
            for k, order in enumerate(orders):
                while pcs[k] < len(order):
                    kind, c, mb = order[pcs[k]]
                    executor.current_action = order[pcs[k]]
                    if kind == FORWARD:
                        if c > 0 and (c - 1, mb) not in acts:
                            break
                        x = batches[mb][0] if c == 0 else acts[(c - 1, mb)].detach().requires_grad_(True)
                        leaves[(c, mb)] = x
                        out = self.versions[c].forward(mb, (x,), self.gaps.get((c, mb), 0), record=self.record)
                        if c == last:
                            out = self.loss_fn(out, batches[mb][1])
                            losses.append(out.item())
                        else:
                            acts[(c, mb)] = out
                        outs[(c, mb)] = out
                    elif kind == BACKWARD:
                        if c < last and (c + 1, mb) not in grads:
                            break
                        out = outs.pop((c, mb))
                        if c == last:
                            (out * self.scale).backward()
                        else:
                            out.backward(grads.pop((c + 1, mb)))
                            acts.pop((c, mb), None)
                        x = leaves.pop((c, mb))
                        if c > 0:
                            grads[(c, mb)] = x.grad
                        self.versions[c].backward_done(mb, record=self.record)
                    elif kind == STEP:
                        self._step(c)
                    else:
                        raise ValueError(f"LocalPipeline cannot run {kind!r} actions ({sched.name})")
                    pcs[k] += 1
                    progressed = True
            if not progressed:
                raise RuntimeError(f"{sched.name}: orders deadlock at {[o[pc] for pc, o in zip(pcs, orders) if pc < len(o)]}")
        if sched.synchronous:
            for k in range(sched.stages):
                self._step(k)
        for v in self.versions:
            v.reset()
        return sum(losses) / len(losses)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The model on its live weights (evaluation)."""
        with torch.no_grad():
            for stage in self.stages:
                x = stage(x)
        return x
