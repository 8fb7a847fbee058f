"""Weight predictors: W_hat = W - lr * s * Delta from an optimizer's own update rule.

``Delta`` is the optimizer's last update direction per unit of learning rate, read from
its state where the state holds it (momentum buffers, Adam moments) and captured at the
step where it does not (the last gradient of plain SGD, Nesterov and RMSprop). PipeOptim
assumes the next ``s`` updates repeat it.

Extension point: ``register_predictor(OptimizerClass, PredictorClass)`` in-process, or the
entry-point group ``ds_chimera.predictors`` (``name = pkg.module:PredictorClass``; the class
sets ``optimizers``, the optimizer classes it serves). ``LastUpdate`` serves any optimizer:
it records the update the step actually applied, at the cost of one weight copy.
"""
from __future__ import annotations

from importlib import metadata

import torch

from ..logs import get_logger

ENTRY_POINT_GROUP = "ds_chimera.predictors"
log = get_logger()


class Predictor:
    """Base class. ``optimizer`` is a torch optimizer whose params are the live weights."""

    name = ""
    optimizers: tuple = ()     # optimizer classes this predictor understands
    stateful: tuple = ()       # attributes holding {param: tensor}, saved with checkpoints

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer          # a torch optimizer, or a view with master_value/master_grad
        self.group_of = {p: g for g in optimizer.param_groups for p in g["params"]}

    def value(self, p: torch.Tensor) -> torch.Tensor:
        """The weights the optimizer updates: ``p`` itself, or its fp32 master copy (bf16)."""
        get = getattr(self.optimizer, "master_value", None)
        return p.detach() if get is None else get(p)

    def grad(self, p: torch.Tensor):
        """The gradient the optimizer will read for ``p`` (fp32 under bf16), or None."""
        get = getattr(self.optimizer, "master_grad", None)
        return p.grad if get is None else get(p)

    def _param_list(self) -> list:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def state_dict(self) -> dict:
        """Per-parameter state by position in the optimizer's groups, for checkpoints."""
        index = {p: i for i, p in enumerate(self._param_list())}
        return {"name": self.name, **{attr: {index[p]: t.detach().clone() for p, t in getattr(self, attr).items()}
                                      for attr in self.stateful}}

    def load_state_dict(self, state: dict) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"predictor state was saved by {state.get('name')!r}, this run uses {self.name!r}")
        params = self._param_list()
        for attr in self.stateful:
            setattr(self, attr, {params[i]: t.to(params[i].device) for i, t in state[attr].items()})

    # hooks the runtime calls around every optimizer step
    def before_step(self) -> None:
        """Capture what the step consumes and the state does not keep (gradients are zeroed after)."""

    def after_step(self) -> None:
        """Update any state of the predictor's own."""

    def direction(self, p: torch.Tensor):
        """The last update direction per unit of learning rate, or None before the first step."""
        raise NotImplementedError

    @torch.no_grad()
    def predict(self, p: torch.Tensor, steps: int) -> torch.Tensor:
        """W_hat for ``steps`` updates ahead (a new tensor; ``p`` itself when nothing is known)."""
        if steps == 0:
            return p
        delta = self.direction(p)
        if delta is None:
            return p
        return self.value(p) - self.group_of[p]["lr"] * steps * delta

    def _grad_plus_l2(self, p: torch.Tensor, group: dict):
        """The gradient as torch's SGD/RMSprop/Adam see it: g + weight_decay * W (coupled L2)."""
        g = self.grad(p)
        if g is None:
            return None
        w = self.value(p)
        g = g.detach().to(w.dtype)
        wd = group.get("weight_decay", 0.0)
        return g + wd * w if wd else g.clone()


class _KeepsLastGradient(Predictor):
    """Keeps each step's (L2-decayed) gradient where the optimizer's state does not hold the direction."""

    stateful = ("last",)

    def __init__(self, optimizer):
        super().__init__(optimizer)
        self.last = {}

    def needs_gradient(self, group: dict) -> bool:
        raise NotImplementedError

    def before_step(self):
        for group in self.optimizer.param_groups:
            if not self.needs_gradient(group):
                continue
            for p in group["params"]:
                d = self._grad_plus_l2(p, group)
                if d is not None:
                    self.last[p] = d


class SGDPredictor(_KeepsLastGradient):
    """torch.optim.SGD. Momentum: Delta is the momentum buffer. Nesterov: g + momentum * buffer.
    Plain SGD: the last (L2-decayed) gradient."""

    name = "sgd"
    optimizers = (torch.optim.SGD,)

    def needs_gradient(self, group):
        # with plain momentum the buffer is the whole direction
        return not group.get("momentum", 0.0) or group.get("nesterov", False)

    def direction(self, p):
        group = self.group_of[p]
        momentum = group.get("momentum", 0.0)
        if not momentum:
            return self.last.get(p)
        buf = self.optimizer.state.get(p, {}).get("momentum_buffer")
        if buf is None:
            return None
        if group.get("nesterov", False):
            g = self.last.get(p)
            return None if g is None else g + momentum * buf
        return buf


class AdamPredictor(Predictor):
    """torch.optim.Adam / AdamW: Delta = m_hat / (sqrt(v_hat) + eps), with the current bias
    corrections (and the running max of v under amsgrad). AdamW's decoupled decay is applied
    separately: W_hat = W - lr * s * (Delta + weight_decay * W)."""

    name = "adam"
    optimizers = (torch.optim.Adam, torch.optim.AdamW)

    def direction(self, p):
        state = self.optimizer.state.get(p, {})
        if "exp_avg" not in state:
            return None
        group = self.group_of[p]
        beta1, beta2 = group["betas"]
        step = float(state["step"])
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if group.get("amsgrad", False):
            v = state["max_exp_avg_sq"]
        bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
        return (m / bc1) / ((v / bc2).sqrt() + group["eps"])

    def _decoupled(self, p) -> float:
        group = self.group_of[p]
        decoupled = group.get("decoupled_weight_decay", isinstance(inner(self.optimizer), torch.optim.AdamW))
        return group.get("weight_decay", 0.0) if decoupled else 0.0

    @torch.no_grad()
    def predict(self, p, steps):
        delta = self.direction(p) if steps else None
        if delta is None:
            return p
        lr, wd, w = self.group_of[p]["lr"], self._decoupled(p), self.value(p)
        out = w - lr * steps * delta
        return out - lr * wd * steps * w if wd else out


class RMSpropPredictor(_KeepsLastGradient):
    """torch.optim.RMSprop: Delta = the momentum buffer, or g / (sqrt(v) + eps) without momentum
    (centered: v minus the squared mean gradient)."""

    name = "rmsprop"
    optimizers = (torch.optim.RMSprop,)

    def needs_gradient(self, group):
        return not group.get("momentum", 0.0)

    def direction(self, p):
        group, state = self.group_of[p], self.optimizer.state.get(p, {})
        if group.get("momentum", 0.0):
            return state.get("momentum_buffer")
        g = self.last.get(p)
        if g is None or "square_avg" not in state:
            return None
        avg = state["square_avg"]
        if group.get("centered", False):
            avg = avg - state["grad_avg"] ** 2
        return g / (avg.sqrt() + group["eps"])


class LastUpdate(Predictor):
    """Any optimizer: Delta = (W before the step - W after it) / lr, measured at each step."""

    name = "last-update"
    optimizers = (torch.optim.Optimizer,)
    stateful = ("delta",)

    def __init__(self, optimizer):
        super().__init__(optimizer)
        self.before, self.delta = {}, {}

    def before_step(self):
        self.before = {p: self.value(p).clone() for group in self.optimizer.param_groups for p in group["params"]
                       if self.grad(p) is not None}

    def after_step(self):
        for p, old in self.before.items():
            lr = self.group_of[p]["lr"]
            if lr:
                self.delta[p] = (old - self.value(p)) / lr
        self.before = {}

    def direction(self, p):
        return self.delta.get(p)


class SmoothedGradient(Predictor):
    """SpecTrain: Delta from v <- gamma * v + (1 - gamma) * g at every step, whatever the optimizer.

    SpecTrain writes momentum SGD as W -= eta * v with this v; torch's SGD sums instead
    (buf = gamma * buf + g, W -= lr * buf), so Delta = v / (1 - gamma) in torch's units. Under
    momentum SGD that is the optimizer's own step, as SpecTrain intends; under Adam it is not,
    which is the gap PipeOptim's optimizer-dependent prediction closes.
    """

    name = "smoothed-gradient"
    optimizers = ()
    stateful = ("avg",)

    def __init__(self, optimizer, smoothing: float = 0.9):
        super().__init__(optimizer)
        self.smoothing = float(smoothing)
        self.avg = {}

    def before_step(self):
        gamma = self.smoothing
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                g = self.grad(p)
                if g is None:
                    continue
                g = g.detach().float()
                v = self.avg.get(p)     # v starts at 0: after one step v / (1 - gamma) is g, torch's buffer
                self.avg[p] = (1 - gamma) * g if v is None else v.mul_(gamma).add_(g, alpha=1 - gamma)

    def direction(self, p):
        v = self.avg.get(p)
        return None if v is None else v / (1.0 - self.smoothing)


def inner(optimizer):
    """The torch optimizer behind a view (bf16 master weights), for choosing by class."""
    return getattr(optimizer, "inner", optimizer)


_BUILTIN = (SGDPredictor, AdamPredictor, RMSpropPredictor, LastUpdate, SmoothedGradient)
_REGISTERED: dict = {}     # optimizer class -> predictor class
_WARNED: set = set()


def register_predictor(optimizer_cls: type, predictor_cls: type) -> None:
    """Serve ``optimizer_cls`` (and its subclasses) with ``predictor_cls`` under ``auto``."""
    if not (isinstance(predictor_cls, type) and issubclass(predictor_cls, Predictor)):
        raise ValueError(f"register_predictor needs a Predictor subclass, got {predictor_cls!r}")
    _REGISTERED[optimizer_cls] = predictor_cls


def available() -> dict:
    """name -> predictor class: built-ins, entry-point plugins, in-process registrations."""
    found = {cls.name: cls for cls in _BUILTIN}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            cls = ep.load()
        except Exception as exc:   # a broken plugin must not take the built-ins down
            log.warning("predictor plugin %r (%s) failed to load: %s", ep.name, ep.value, exc)
            continue
        if isinstance(cls, type) and issubclass(cls, Predictor):
            found[ep.name] = cls
    found.update({cls.name or cls.__name__: cls for cls in _REGISTERED.values()})
    return found


def _by_optimizer() -> list:
    """(optimizer class, predictor class), most specific registrations first."""
    pairs = list(_REGISTERED.items())
    for cls in available().values():
        pairs += [(opt, cls) for opt in cls.optimizers if opt is not torch.optim.Optimizer]
    return pairs


def predictor_for(schedule, optimizer) -> Predictor:
    """The predictor an asynchronous schedule's options ask for (SpecTrain: the smoothed gradient)."""
    if schedule.name == "spectrain":
        return SmoothedGradient(optimizer, schedule.config["smoothing"])
    return make_predictor(optimizer, schedule.config["predictor"])


def make_predictor(optimizer, choice: str = "auto", **kwargs) -> Predictor:
    """The predictor for ``optimizer``: by its class under ``auto``, else the named one."""
    table = available()
    if choice == "auto":
        # the most specific optimizer class wins (earliest in the MRO); among equals, registrations first
        mro = type(inner(optimizer)).__mro__
        matches = [(mro.index(opt_cls), i, cls) for i, (opt_cls, cls) in enumerate(_by_optimizer())
                   if opt_cls in mro]
        if matches:
            return min(matches, key=lambda m: m[:2])[2](optimizer, **kwargs)
        if type(inner(optimizer)) not in _WARNED:
            _WARNED.add(type(inner(optimizer)))
            log.warning("ds_chimera: no weight predictor knows %s; using 'last-update', which keeps one "
                        "extra weight copy to measure each update", type(inner(optimizer)).__name__)
        return LastUpdate(optimizer, **kwargs)
    if choice not in table:
        raise ValueError(f"unknown weight predictor {choice!r}; available: auto, {', '.join(sorted(table))}")
    cls = table[choice]
    if cls.optimizers and torch.optim.Optimizer not in cls.optimizers and \
            not isinstance(inner(optimizer), cls.optimizers):
        raise ValueError(f"predictor {choice!r} reads the state of {[c.__name__ for c in cls.optimizers]}, "
                         f"not of {type(inner(optimizer)).__name__}; use 'auto' or 'last-update'")
    return cls(optimizer, **kwargs)
