"""The runtime's split backward (I then W) gives the fused backward's gradients."""
import torch

from ds_chimera.runtime.executor import split_input_grad


def fused(layers, x):
    x = x.detach().requires_grad_(True)
    out = x
    for layer in layers:
        out = torch.tanh(layer(out))
    out.sum().backward()
    return x.grad, [p.grad.clone() for layer in layers for p in layer.parameters()]


def split(layers, x):
    x = x.detach().requires_grad_(True)
    out, blocks = x, []
    for layer in layers:
        out = torch.tanh(layer(out))
        blocks.append((out, list(layer.parameters())))
    work = split_input_grad([out.sum()], None, [x], blocks)
    grad_x = x.grad.clone()
    for outs, grads, params in work:           # W, later in the schedule
        torch.autograd.backward(outs, grad_tensors=grads, inputs=params)
    return grad_x, [p.grad.clone() for layer in layers for p in layer.parameters()]


def assert_split_matches_fused(layers, x):
    gx_f, gw_f = fused(layers, x)
    for layer in layers:
        layer.zero_grad()
    gx_s, gw_s = split(layers, x)
    torch.testing.assert_close(gx_s, gx_f)
    for a, b in zip(gw_s, gw_f):
        torch.testing.assert_close(a, b)


def test_split_equals_fused_for_separate_layers():
    torch.manual_seed(0)
    assert_split_matches_fused([torch.nn.Linear(4, 4) for _ in range(3)], torch.randn(5, 4))


def test_split_equals_fused_when_a_layer_is_used_twice_in_a_chunk():
    torch.manual_seed(0)
    shared = torch.nn.Linear(4, 4)
    assert_split_matches_fused([shared, torch.nn.Linear(4, 4), shared], torch.randn(5, 4))   # a tie in one chunk
