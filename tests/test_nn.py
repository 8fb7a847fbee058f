"""fairseq-compatible layers, incremental decoding, and the DynamicConv LM."""
import pytest
import torch

from ds_chimera.nn import ConvLM, DynamicConv1dTBC, LightweightConv1dTBC, counting_batches, lm_loss
from ds_chimera.ops.reference import dynamicconv_band, lightconv_band


def test_parameter_names_and_shapes_match_fairseq():
    light = LightweightConv1dTBC(16, kernel_size=5, padding_l=4, num_heads=4, bias=True)
    assert {k: tuple(v.shape) for k, v in light.state_dict().items()} == {"weight": (4, 1, 5), "bias": (16,)}
    dyn = DynamicConv1dTBC(16, kernel_size=5, padding_l=4, num_heads=4, bias=True, conv_bias=True)
    assert {k: tuple(v.shape) for k, v in dyn.state_dict().items()} == {
        "weight_linear.weight": (20, 16), "weight_linear.bias": (20,), "conv_bias": (16,)}
    proj = DynamicConv1dTBC(16, kernel_size=3, num_heads=2, in_proj=True)
    assert tuple(proj.weight_linear.weight.shape) == (16 + 6, 16) and proj.in_proj


def test_lightconv_layer_is_the_banded_reference_in_tbc():
    torch.manual_seed(0)
    layer = LightweightConv1dTBC(8, kernel_size=4, padding_l=2, num_heads=2, weight_softmax=True, bias=True).double()
    x = torch.randn(9, 3, 8, dtype=torch.float64)
    kernel = torch.softmax(layer.weight.view(2, 4), dim=1)
    want = lightconv_band(x.permute(1, 2, 0), kernel, 2).permute(2, 0, 1) + layer.bias
    torch.testing.assert_close(layer(x), want)


def test_dynamicconv_layer_is_the_banded_reference_in_tbc():
    torch.manual_seed(0)
    layer = DynamicConv1dTBC(8, kernel_size=3, padding_l=1, num_heads=2, weight_softmax=True, conv_bias=True).double()
    x = torch.randn(7, 2, 8, dtype=torch.float64)
    logits = layer.weight_linear(x).view(7, 2, 2, 3).permute(1, 2, 3, 0)
    want = dynamicconv_band(x.permute(1, 2, 0), torch.softmax(logits, dim=2), 1).permute(2, 0, 1) + layer.conv_bias
    torch.testing.assert_close(layer(x), want)


LAYERS = [
    lambda: LightweightConv1dTBC(8, kernel_size=4, padding_l=3, num_heads=2, weight_softmax=True, bias=True),
    lambda: LightweightConv1dTBC(8, kernel_size=1, padding_l=0, num_heads=1, bias=True),
    lambda: DynamicConv1dTBC(8, kernel_size=5, padding_l=4, num_heads=4, weight_softmax=True, conv_bias=True),
    lambda: DynamicConv1dTBC(8, kernel_size=3, padding_l=2, num_heads=2, weight_softmax=True,
                             renorm_padding=True, in_proj=True),
    lambda: DynamicConv1dTBC(8, kernel_size=2, padding_l=1, num_heads=8, weight_softmax=False),
]


@pytest.mark.parametrize("backend", ["cpp", "torch"])
@pytest.mark.parametrize("layer", LAYERS)
def test_incremental_decoding_equals_full_sequence_with_several_tokens_per_step(layer, backend):
    """One token per call takes the decoding-step op, several tokens (or gradients) the
    full-sequence op on the window: every mix equals the full sequence."""
    torch.manual_seed(1)
    module = layer().double().eval()
    module.backend = backend
    x = torch.randn(12, 3, 8, dtype=torch.float64)
    full = module(x)
    calls = [(0, 1), (1, 2), (2, 6), (6, 7), (7, 8), (8, 9), (9, 12)]     # 1, 1, 4, 1, 1, 1 and 3 tokens
    for grad in (False, True):
        state, outputs = {}, []
        with torch.set_grad_enabled(grad):
            for start, stop in calls:
                outputs.append(module(x[start:stop], incremental_state=state))
        torch.testing.assert_close(torch.cat(outputs), full, rtol=1e-12, atol=1e-12)
        assert all(out.requires_grad == grad for out in outputs)
    kept = module.kernel_size - 1
    before = module.input_buffer(state)
    inputs = module.weight_linear(x)[..., :8] if getattr(module, "in_proj", False) else x
    torch.testing.assert_close(before, inputs[12 - kept:].detach())          # the last K-1 inputs, oldest first
    order = torch.tensor([2, 0, 1])
    module.reorder_incremental_state(state, order)                          # beam search reordering
    torch.testing.assert_close(module.input_buffer(state), before[:, order])
    if getattr(module, "in_proj", False):
        return                                     # its buffer holds projected inputs: no full-sequence twin
    z = torch.randn(1, 3, 8, dtype=torch.float64)
    with torch.no_grad():                                                   # decoding goes on in the new order
        step = module(z, incremental_state=state)
    torch.testing.assert_close(step, module(torch.cat([before[:, order], z]))[-1:], rtol=1e-12, atol=1e-12)


def test_decoding_steps_from_the_first_token_match_the_full_sequence_in_fp32():
    """fp32, one token at a time from an empty state through the C++ step, 31 taps (more than
    the sequence at first, so the zero rows of the buffer act as the causal padding)."""
    torch.manual_seed(2)
    for layer in (LightweightConv1dTBC(64, 31, padding_l=30, num_heads=4, weight_softmax=True),
                  DynamicConv1dTBC(64, 31, padding_l=30, num_heads=4, weight_softmax=True, renorm_padding=True)):
        layer.eval()
        x = torch.randn(40, 2, 64)
        state = {}
        with torch.no_grad():
            steps = torch.cat([layer(x[t:t + 1], incremental_state=state) for t in range(40)])
            torch.testing.assert_close(steps, layer(x), rtol=1e-5, atol=1e-6)


def test_weight_dropout_is_dropconnect_on_the_normalised_kernel():
    torch.manual_seed(0)
    layer = LightweightConv1dTBC(4, kernel_size=8, padding_l=7, num_heads=2, weight_softmax=True, weight_dropout=0.5)
    layer.train()
    kernel = layer.kernel()
    normalised = torch.softmax(layer.weight.view(2, 8), dim=1)
    kept = kernel != 0
    assert 0 < kept.sum() < kernel.numel()
    torch.testing.assert_close(kernel[kept], (normalised / 0.5)[kept])    # dropped, scaled, not renormalised
    layer.eval()
    torch.testing.assert_close(layer.kernel(), normalised)


def test_bad_layer_arguments():
    with pytest.raises(ValueError, match="num_heads must divide input_size: num_heads=3, input_size=8"):
        LightweightConv1dTBC(8, kernel_size=3, num_heads=3)
    with pytest.raises(ValueError, match=r"padding_l must be in \[0, kernel_size-1\] = \[0, 2\], got 3"):
        DynamicConv1dTBC(8, kernel_size=3, padding_l=3)
    layer = LightweightConv1dTBC(8, kernel_size=3, padding_l=1)
    with pytest.raises(ValueError, match="incremental decoding needs causal padding"):
        layer(torch.randn(1, 2, 8), incremental_state={})


def test_dynamicconv_lm_learns_the_counting_task():
    torch.manual_seed(0)
    model = ConvLM(vocab_size=32, d_model=32, num_layers=2, kernel_sizes=(3, 7), num_heads=4, max_len=16)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    data = counting_batches(16, seq_len=16, vocab_size=32, seed=0)
    losses = []
    for _ in range(40):
        ids, targets = next(data)
        loss = lm_loss(model(ids), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 3.0 and sum(losses[-5:]) / 5 < 0.5 * losses[0], losses
