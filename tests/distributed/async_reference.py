"""An independent single-process model of asynchronous 1F1B: PipeDream, PipeDream-2BW, PipeOptim, SpecTrain.

Written from the methods' definitions, with nothing from ``ds_chimera`` (no schedule tables,
weight-version policies, predictors, executor or optimizers), so that the engine and
``LocalPipeline``, which share those, can be checked against something else:

- **The timetable** (:func:`async_1f1b`): asynchronous 1F1B simulated in unit time slots
  (F = B = 1 slot, a result usable in the next slot). Stage k of D runs, in each slot, the
  backward of its oldest mini-batch in flight once that mini-batch's gradient has arrived,
  else the next forward whose input has arrived if fewer than D-k mini-batches are in
  flight (PipeDream's admission: the input stage keeps D in flight), else nothing. A stage
  updates its weights right after every ``interval``-th backward (1; 2BW: D by default).
  One call (``fill='call'``) starts from an empty pipeline and drains it; weights and
  optimizer state carry over to the next call.
- **Which weights each pass uses** (:func:`pass_plan`), counting the updates stage k has
  applied since training began:

  - PipeDream (weight stashing) and 2BW: the forward uses the live weights, version v_F;
    the backward the same version v_F (the stashed copy), whatever was applied in between.
  - PipeOptim and SpecTrain: the forward uses weights predicted s updates ahead of the live
    version v_F, W_hat = W - lr * s * Delta; the backward uses the live weights then, v_B.
    s is the number of updates really applied between the two (``paper``: D-1-k once the
    pipeline is full, fewer in the warm-up after a flush), one more (``code``, as the
    published code), or a fixed integer. With no update applied yet there is nothing to
    predict from and W_hat = W.
- **Delta** (:class:`SGD`, :class:`Adam`, :class:`AsyncReference`): PipeOptim's is the
  optimizer's own last update direction per unit of learning rate: the momentum buffer for
  SGD with momentum, g + momentum * buffer for Nesterov, the (L2-decayed) gradient for plain
  SGD, m_hat / (sqrt(v_hat) + eps) for Adam/AdamW with AdamW's decoupled decay added as
  lr * s * lambda * W; ``last-update``: the update really applied, divided by lr. SpecTrain's
  is the smoothed gradient v <- gamma v + (1 - gamma) g in units of torch's momentum buffer,
  v / (1 - gamma), whatever the optimizer.
- **The numbers**: stages of ``nn.Linear`` and ``nn.Tanh`` layers, forward and backward
  written out by hand. A backward's input gradient uses the weights its method names (the
  stash, or the live ones); its weight gradient uses the activations its forward saved.
  Loss: the mean squared error per mini-batch, divided by the update interval.
  Per-stage gradient clipping (torch's definition, coefficient max / (norm + 1e-6)) where
  asked. Data parallelism is not modelled: replicas' micro-batches concatenated form the
  mini-batch, whose mean loss is the replicas' average.
"""
from __future__ import annotations

import math

import torch
from torch import nn

STASH, PREDICT = "stash", "predict"
METHODS = {"pipedream": STASH, "pipedream-2bw": STASH, "pipeoptim": PREDICT, "spectrain": PREDICT}


# ---- the timetable ---------------------------------------------------------------------------------
def async_1f1b(depth: int, n: int, interval: int = 1) -> list:
    """One call's slots: ``slots[t]`` lists (stage, kind, mb) run in slot t; kind "F", "B" or "S" (update)."""
    if n % interval:
        raise ValueError(f"{n} mini-batches are not a whole number of updates of {interval}")
    fwd_at, bwd_at = {}, {}                      # (stage, mb) -> slot it ran in
    next_fwd, done = [0] * depth, [0] * depth
    inflight = [[] for _ in range(depth)]
    slots, t = [], 0
    while any(d < n for d in done):
        now = []
        for k in range(depth):
            event = None
            if inflight[k]:
                m = inflight[k][0]
                arrived = fwd_at.get((k, m), t) < t if k == depth - 1 else bwd_at.get((k + 1, m), t) < t
                if arrived:
                    event = ("B", m)
            if event is None and next_fwd[k] < n and len(inflight[k]) < depth - k:
                m = next_fwd[k]
                if k == 0 or fwd_at.get((k - 1, m), t) < t:
                    event = ("F", m)
            if event is None:
                continue
            kind, m = event
            now.append((k, kind, m))
            if kind == "F":
                fwd_at[(k, m)] = t
                inflight[k].append(m)
                next_fwd[k] += 1
            else:
                bwd_at[(k, m)] = t
                inflight[k].pop(0)
                done[k] += 1
                if done[k] % interval == 0:
                    now.append((k, "S", m))
        slots.append(now)
        t += 1
        if t > 4 * (n + depth) + 8:
            raise RuntimeError("the asynchronous 1F1B timetable made no progress")
    return slots


def call_versions(slots: list, depth: int) -> dict:
    """(stage, mb) -> (updates applied in this call before its forward, ... before its backward)."""
    applied, fwd, out = [0] * depth, {}, {}
    for now in slots:
        for k, kind, m in now:
            if kind == "F":
                fwd[(k, m)] = applied[k]
            elif kind == "B":
                out[(k, m)] = (fwd[(k, m)], applied[k])
            else:
                applied[k] += 1
    return out


def default_interval(method: str, depth: int, update_interval=None) -> int:
    if method == "pipedream-2bw":
        return depth if update_interval is None else update_interval
    return 1


def steps_ahead_of(choice, gap: int) -> int:
    """How far a predicted forward looks, given the real distance ``gap`` to its backward."""
    if choice == "paper":
        return gap
    if choice == "code":
        return gap + 1
    return int(choice)


def pass_plan(method: str, depth: int, n: int, calls: int, update_interval=None, steps_ahead="paper") -> dict:
    """(kind, stage, mb, call) -> (version its weights start from, updates it predicts ahead).

    Versions count the updates the stage applied since training began (every call adds
    n / interval). The forward of a predicting method looks ahead only once an update exists.
    """
    interval = default_interval(method, depth, update_interval)
    per_call = n // interval
    versions = call_versions(async_1f1b(depth, n, interval), depth)
    plan = {}
    for call in range(calls):
        base = call * per_call
        for (k, m), (f, b) in versions.items():
            if METHODS[method] == STASH:
                plan[("F", k, m, call)] = plan[("B", k, m, call)] = (base + f, 0)
            else:
                ahead = steps_ahead_of(steps_ahead, b - f) if base + f > 0 else 0
                plan[("F", k, m, call)] = (base + f, ahead)
                plan[("B", k, m, call)] = (base + b, 0)
    return plan


def probe_versions(method: str, depth: int, n: int, calls: int, update_interval=None, steps_ahead="paper") -> dict:
    """What a weight that counts its updates (+1 each) reads in each pass: a prediction s ahead reads v + s."""
    return {key: float(v + s) for key, (v, s) in pass_plan(method, depth, n, calls, update_interval,
                                                           steps_ahead).items()}


def versions_held(method: str, depth: int, n: int, update_interval=None, steps_ahead="paper") -> list:
    """Per stage, the most weight versions alive at once in a call after the first (live + stashed/predicted)."""
    interval = default_interval(method, depth, update_interval)
    slots = async_1f1b(depth, n, interval)
    gaps = {key: b - f for key, (f, b) in call_versions(slots, depth).items()}
    peaks, applied, inflight = [1] * depth, [0] * depth, [dict() for _ in range(depth)]
    for now in slots:
        for k, kind, m in now:
            if kind == "F":
                inflight[k][m] = applied[k]
                if METHODS[method] == PREDICT and steps_ahead_of(steps_ahead, gaps[(k, m)]) > 0:
                    peaks[k] = max(peaks[k], 2)
            elif kind == "B":
                del inflight[k][m]
            else:
                applied[k] += 1
            if METHODS[method] == STASH:
                peaks[k] = max(peaks[k], len(set(inflight[k].values()) | {applied[k]}))
    return peaks


# ---- optimizers, written out -------------------------------------------------------------------------
class SGD:
    """torch.optim.SGD's update (dampening 0). ``direction``: the update just applied per unit of lr."""

    def __init__(self, lr, momentum=0.0, weight_decay=0.0, nesterov=False):
        self.lr, self.momentum, self.weight_decay, self.nesterov = lr, momentum, weight_decay, nesterov
        self.buf, self.direction, self.decoupled = None, None, 0.0

    def step(self, params, grads):
        gs = [g + self.weight_decay * p if self.weight_decay else g.clone() for p, g in zip(params, grads)]
        if self.momentum:
            self.buf = [g.clone() for g in gs] if self.buf is None else \
                [self.momentum * b + g for b, g in zip(self.buf, gs)]
            d = [g + self.momentum * b for g, b in zip(gs, self.buf)] if self.nesterov else self.buf
        else:
            d = gs
        self.direction = [x.clone() for x in d]
        for p, x in zip(params, d):
            p.sub_(self.lr * x)


class Adam:
    """Adam (``decoupled``: AdamW's decay lr * lambda * W, applied before the step, as torch does)."""

    def __init__(self, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=False):
        self.lr, (self.b1, self.b2), self.eps = lr, betas, eps
        self.weight_decay, self.decoupled = weight_decay, weight_decay if decoupled else 0.0
        self.m = self.v = None
        self.t, self.direction = 0, None

    def step(self, params, grads):
        if not self.decoupled and self.weight_decay:
            grads = [g + self.weight_decay * p for p, g in zip(params, grads)]
        if self.m is None:
            self.m = [torch.zeros_like(p) for p in params]
            self.v = [torch.zeros_like(p) for p in params]
        self.t += 1
        self.m = [self.b1 * m + (1 - self.b1) * g for m, g in zip(self.m, grads)]
        self.v = [self.b2 * v + (1 - self.b2) * g * g for v, g in zip(self.v, grads)]
        bc1, bc2 = 1 - self.b1 ** self.t, 1 - self.b2 ** self.t
        self.direction = [(m / bc1) / ((v / bc2).sqrt() + self.eps) for m, v in zip(self.m, self.v)]
        for p, d in zip(params, self.direction):
            if self.decoupled:
                p.mul_(1 - self.lr * self.decoupled)
            p.sub_(self.lr * d)


# ---- the model -------------------------------------------------------------------------------------------
def _layers(stage: nn.Module) -> list:
    layers = [m for m in stage.modules() if not list(m.children())]
    for layer in layers:
        if not isinstance(layer, (nn.Linear, nn.Tanh)):
            raise TypeError(f"the reference runs nn.Linear and nn.Tanh layers, not {type(layer).__name__}")
    return layers


def _forward(layers: list, weights: list, x):
    """(output, what the backward needs): each Linear's input, each Tanh's output."""
    saved, i = [], 0
    for layer in layers:
        if isinstance(layer, nn.Linear):
            w, b = weights[i], weights[i + 1] if layer.bias is not None else None
            i += 2 if layer.bias is not None else 1
            saved.append(x)
            x = x @ w.T + (b if b is not None else 0)
        else:
            x = torch.tanh(x)
            saved.append(x)
    return x, saved


def _backward(layers: list, weights: list, saved: list, g, grads: list):
    """Accumulate weight gradients into ``grads``; the input gradient uses ``weights``."""
    offsets, i = [], 0
    for layer in layers:
        offsets.append(i)
        if isinstance(layer, nn.Linear):
            i += 2 if layer.bias is not None else 1
    for layer, s, j in reversed(list(zip(layers, saved, offsets))):
        if isinstance(layer, nn.Linear):
            grads[j] += g.T @ s
            if layer.bias is not None:
                grads[j + 1] += g.sum(0)
            g = g @ weights[j]
        else:
            g = g * (1 - s * s)
    return g


class AsyncReference:
    """``method`` trained on ``stages`` (modules of Linear/Tanh layers, updated in place).

    ``optimizer``: an :class:`SGD` or :class:`Adam` factory (called once per stage).
    ``predictor``: ``"optimizer"`` (PipeOptim's optimizer-dependent Delta) or ``"last-update"``.
    """

    def __init__(self, method, stages, optimizer, steps_ahead="paper", predictor="optimizer", smoothing=0.9,
                 update_interval=None, clip=0.0):
        if method not in METHODS:
            raise ValueError(method)
        self.method, self.policy = method, METHODS[method]
        self.depth = len(stages)
        self.layers = [_layers(s) for s in stages]
        self.params = [[p for layer in ls if isinstance(layer, nn.Linear) for p in layer.parameters()]
                       for ls in self.layers]
        self.opts = [optimizer() for _ in stages]
        self.steps_ahead, self.predictor, self.smoothing, self.clip = steps_ahead, predictor, smoothing, clip
        self.interval = default_interval(method, self.depth, update_interval)
        self.applied = [0] * self.depth
        self.smoothed = [None] * self.depth         # SpecTrain's v
        self.measured = [None] * self.depth         # last-update: the applied update / lr
        self.norms = [[] for _ in stages]           # each update's stage gradient norm (before clipping)
        self.seen = {}                               # (kind, stage, mb, call) -> (version, ahead)
        self.calls = 0

    # Delta per unit of lr, and the decoupled decay to add to it (None before any update)
    def _delta(self, k):
        opt = self.opts[k]
        if self.method == "spectrain":
            v = self.smoothed[k]
            return None if v is None else ([x / (1 - self.smoothing) for x in v], 0.0)
        if self.predictor == "last-update":
            return None if self.measured[k] is None else (self.measured[k], 0.0)
        return None if opt.direction is None else (opt.direction, opt.decoupled)

    def _predicted(self, k, live, ahead):
        delta = self._delta(k) if ahead else None
        if delta is None:
            return live, 0
        d, decay = delta
        lr = self.opts[k].lr
        return [w - lr * ahead * (x + decay * w) if decay else w - lr * ahead * x for w, x in zip(live, d)], ahead

    def _update(self, k, grads):
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
        self.norms[k].append(norm)
        if self.clip > 0 and self.clip / (norm + 1e-6) < 1:
            grads = [g * (self.clip / (norm + 1e-6)) for g in grads]
        if self.method == "spectrain":
            gamma, v = self.smoothing, self.smoothed[k]
            self.smoothed[k] = [(1 - gamma) * g for g in grads] if v is None else \
                [gamma * a + (1 - gamma) * g for a, g in zip(v, grads)]
        before = [p.detach().clone() for p in self.params[k]]
        with torch.no_grad():
            self.opts[k].step(self.params[k], grads)
        lr = self.opts[k].lr
        self.measured[k] = [(b - p.detach()) / lr for b, p in zip(before, self.params[k])]
        self.applied[k] += 1

    def train_call(self, batches: list) -> float:
        """One call: the mini-batches ``batches`` [(x, y)] through a filled and drained pipeline; the mean loss."""
        n, depth, call = len(batches), self.depth, self.calls
        slots = async_1f1b(depth, n, self.interval)
        gaps = {key: b - f for key, (f, b) in call_versions(slots, depth).items()}
        acts, back, stored, losses = {}, {}, {}, []
        grads = [[torch.zeros_like(p) for p in ps] for ps in self.params]
        for now in slots:
            for k, kind, m in now:
                if kind == "F":
                    x = batches[m][0] if k == 0 else acts.pop((k - 1, m))
                    live = [p.detach().clone() for p in self.params[k]]
                    ahead = steps_ahead_of(self.steps_ahead, gaps[(k, m)]) if self.policy == PREDICT else 0
                    weights, ahead = self._predicted(k, live, ahead)
                    out, saved = _forward(self.layers[k], weights, x)
                    stored[(k, m)] = (saved, live)
                    self.seen[("F", k, m, call)] = (self.applied[k], ahead)
                    if k == depth - 1:
                        y = batches[m][1]
                        losses.append(float(((out - y) ** 2).mean()))
                        back[(k + 1, m)] = 2 * (out - y) / out.numel() / self.interval
                    else:
                        acts[(k, m)] = out
                elif kind == "B":
                    saved, stash = stored.pop((k, m))
                    weights = stash if self.policy == STASH else [p.detach() for p in self.params[k]]
                    version = self.seen[("F", k, m, call)][0] if self.policy == STASH else self.applied[k]
                    self.seen[("B", k, m, call)] = (version, 0)
                    g = _backward(self.layers[k], weights, saved, back.pop((k + 1, m)), grads[k])
                    if k > 0:
                        back[(k, m)] = g
                else:
                    self._update(k, grads[k])
                    grads[k] = [torch.zeros_like(p) for p in self.params[k]]
        self.calls += 1
        return sum(losses) / len(losses)
