"""The executor's backward calls (ds_chimera.autograd_calls) give what torch's public functions give.

They enter torch's engine without the public functions' per-call checks where those cannot fail; each case
here runs both ways on the same graph and compares every gradient bit for bit, and the cases the direct entry
must leave to torch (a mismatch, a tensor subclass) still raise torch's own error or take its path.
"""
import pytest
import torch
from torch import nn

from ds_chimera import autograd_calls


def graph(seed=0):
    """A two-block chain: x -> block a -> h -> block b -> y, and the leaves."""
    torch.manual_seed(seed)
    a, b = nn.Linear(4, 5), nn.Linear(5, 3)
    x = torch.randn(2, 4, requires_grad=True)
    h = torch.tanh(a(x))
    y = b(h)
    return a, b, x, h, y


def grads_of(*tensors):
    return [None if t.grad is None else t.grad.clone() for t in tensors]


def test_backward_into_chosen_inputs_equals_torch():
    got = {}
    for name, call in (("torch", lambda y, g, ins: torch.autograd.backward([y], grad_tensors=[g], inputs=ins)),
                       ("direct", lambda y, g, ins: autograd_calls.backward([y], [g], inputs=ins))):
        a, b, x, h, y = graph()
        g = torch.ones_like(y) * 0.5
        call(y, g, list(b.parameters()))
        got[name] = grads_of(x, *a.parameters(), *b.parameters())
    assert got["torch"][:3] == [None, None, None]         # only the chosen inputs accumulate
    for want, have in zip(got["torch"], got["direct"]):
        assert (want is None and have is None) or torch.equal(want, have)


def test_grad_with_retained_graph_and_unused_inputs_equals_torch():
    results = {}
    for name, fn in (("torch", lambda *a, **k: torch.autograd.grad(a[0], a[1], grad_outputs=a[2], **k)),
                     ("direct", autograd_calls.grad)):
        a, b, x, h, y = graph()
        unused = torch.zeros(3, requires_grad=True)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
        got = fn([y], [x, h, unused], [g], retain_graph=True, allow_unused=True)
        again = fn([y], [x], [g])                          # the retained graph runs a second time
        results[name] = (got, again, x.grad)
    (t_got, t_again, t_leaf), (d_got, d_again, d_leaf) = results["torch"], results["direct"]
    assert torch.equal(t_got[0], d_got[0]) and torch.equal(t_got[1], d_got[1])
    assert t_got[2] is None and d_got[2] is None
    assert torch.equal(t_again[0], d_again[0])
    assert t_leaf is None and d_leaf is None               # grad() does not accumulate


def test_a_scalar_loss_without_gradient_gets_torchs_implicit_one():
    got = []
    for call in (torch.autograd.backward, autograd_calls.backward):
        a, b, x, h, y = graph()
        call([(y ** 2).mean() * 3.0])
        got.append(grads_of(x, *a.parameters()))
    for want, have in zip(*got):
        assert torch.equal(want, have)


def test_mismatches_keep_torchs_own_errors():
    a, b, x, h, y = graph()
    with pytest.raises(RuntimeError, match="Mismatch in shape"):
        autograd_calls.backward([y], [torch.ones(3)])
    with pytest.raises(RuntimeError, match="implicitly created only for scalar outputs"):
        autograd_calls.backward([y])
    with pytest.raises(RuntimeError, match="does not require grad"):
        autograd_calls.grad([torch.ones(2, 3)], [x], [torch.ones(2, 3)])


def test_a_tensor_subclass_takes_torchs_path(monkeypatch):
    class Tagged(torch.Tensor):
        pass

    calls = []
    real = torch.autograd.backward
    monkeypatch.setattr(torch.autograd, "backward", lambda *a, **k: calls.append(1) or real(*a, **k))
    a, b, x, h, y = graph()
    autograd_calls.backward([y], [torch.ones_like(y)])
    assert calls == []                                     # plain tensors: the direct entry
    a, b, x, h, y = graph()
    autograd_calls.backward([y], [torch.ones_like(y).as_subclass(Tagged)])
    assert calls == [1]
    assert x.grad is not None
