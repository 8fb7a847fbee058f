"""``to_pipeline``: an HF causal LM as LayerSpecs for ``deepspeed.pipe.PipelineModule``.

The specs are built from the model's config and module sizes, and carry references to
the model's tensors (no copies): building a spec makes a fresh layer and copies that
layer's weights into it, so every rank can build any layer, and the pipeline starts from
exactly the model's weights. With tied embeddings the embedding and the head are one
``TiedLayerSpec`` (key ``"embed"``): one weight, its gradient summed across the stages
that use it.
"""
from __future__ import annotations

import torch
from deepspeed.pipe import LayerSpec, TiedLayerSpec

from .layers import DecoderBlockLayer, EmbeddingLayer, HeadLayer, NormLayer, tied_head
from .layout import Layout, describe

TIED_KEY = "embed"
VERIFIED = ("GPT2LMHeadModel", "LlamaForCausalLM")   # tested layer by layer; others are checked numerically


def layer_state(plan, state: dict) -> dict:
    """The part of an HF state dict that belongs to one pipeline layer, under the layer's own names."""
    out = {}
    for part, (_, path) in plan.parts.items():
        head = path + "."
        for key, value in state.items():
            if key.startswith(head):
                out[f"{part}.{key[len(head):]}"] = value
    return out


def _embedding_args(layout: Layout) -> tuple:
    embed = layout.layers[0]
    tokens = embed.parts["tokens"][0]
    positions = embed.parts["positions"][0] if "positions" in embed.parts else None
    return tokens, positions, layout.dropout


def specs_from_layout(layout: Layout, state: dict | None) -> list:
    """LayerSpecs for ``layout``; ``state`` (an HF state dict) gives their weights, None leaves them seeded."""
    specs = []
    embed_state = layer_state(layout.layers[0], state) if state is not None else None
    for plan in layout.layers:
        weights = layer_state(plan, state) if state is not None else None
        if plan.kind == "embed":
            if layout.tied:
                specs.append(TiedLayerSpec(TIED_KEY, EmbeddingLayer, *_embedding_args(layout), state=weights,
                                           tied_weight_attr=["tokens.weight"]))
            else:
                specs.append(LayerSpec(EmbeddingLayer, *_embedding_args(layout), state=weights))
        elif plan.kind == "block":
            specs.append(LayerSpec(DecoderBlockLayer, layout.config, plan.parts["block"][0], layout.rotary,
                                   state=weights))
        elif plan.kind == "norm":
            specs.append(LayerSpec(NormLayer, plan.parts["norm"][0], state=weights))
        elif layout.tied:
            specs.append(TiedLayerSpec(TIED_KEY, EmbeddingLayer, *_embedding_args(layout), state=embed_state,
                                       forward_fn=tied_head, tied_weight_attr=["tokens.weight"]))
        else:
            specs.append(LayerSpec(HeadLayer, plan.parts["proj"][0], state=weights))
    return specs


def to_pipeline(model, *, weights: bool = True, verify: bool | None = None) -> list:
    """LayerSpecs of ``model`` (GPT-2, Llama, or a causal LM with a pp_plan), for ``PipelineModule(layers=...)``.

    Use with ``loss_fn=ds_chimera.hf.causal_lm_loss``. Pipeline inputs are ``input_ids`` or
    ``(input_ids, attention_mask)``; labels as for the HF model (shifted inside the loss).
    ``weights=False`` leaves the layers at their seeded initialisation. ``verify`` runs a
    short forward through the layers in this process and compares it with the model's
    logits; by default only for architectures other than GPT-2 and Llama.
    """
    layout = describe(model)
    specs = specs_from_layout(layout, model.state_dict() if weights else None)
    if verify is None:
        verify = layout.model_class not in VERIFIED
    if verify:
        check_equivalence(model, specs, layout.model_class)
    return specs


def build_layers(specs: list) -> list:
    """Build every spec in this process (tied specs share one module): callables in order."""
    tied, funcs = {}, []
    for spec in specs:
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in tied:
                tied[spec.key] = spec.build()
            module = tied[spec.key]
            funcs.append(module if spec.forward_fn is None else (lambda x, m=module, f=spec.forward_fn: f(m, x)))
        else:
            funcs.append(spec.build())
    return funcs


def run_layers(funcs: list, inputs):
    for func in funcs:
        inputs = func(inputs)
    return inputs


def check_equivalence(model, specs: list, name: str, atol: float = 1e-4) -> None:
    """Raise ValueError if the layers' logits differ from the model's on a short random input."""
    config = model.config
    # longer than a sliding window, so a wrong mask cannot pass unseen
    window = getattr(config, "sliding_window", None) or 0
    length = min(max(8, window + 8), getattr(config, "max_position_embeddings", 8) or 8)
    ids = torch.randint(0, config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    was_training = model.training
    model.eval()
    try:
        funcs = build_layers(specs)
        for f in funcs:
            if isinstance(f, torch.nn.Module):
                f.eval()
        with torch.no_grad():
            device = next(model.parameters()).device
            ours = run_layers([f.to(device) if isinstance(f, torch.nn.Module) else f for f in funcs], ids.to(device))
            theirs = model(input_ids=ids.to(device)).logits
    finally:
        model.train(was_training)
    diff = (ours.float() - theirs.float()).abs().max().item()
    if not diff <= atol:
        raise ValueError(f"cannot convert {name}: its pipeline layers give logits that differ from the model's by "
                         f"{diff:.3g} (> {atol}); its blocks likely need inputs this conversion does not provide")
