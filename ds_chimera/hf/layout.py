"""Which HF modules become which pipeline layers, and how their parameter names map back.

One description serves both directions: :func:`ds_chimera.hf.to_pipeline` builds the layer
specs from it, and :func:`ds_chimera.hf.export_pretrained` renames the per-layer checkpoint
files to the HF names with it. Layers are, in order: the embedding, one layer per decoder
block, the final norm, the head.

A module is described by a *recipe* ``(class, args, kwargs)`` taken from the config and
the module's own sizes, so any rank can build any layer without the others.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

SUPPORTED = ("GPT2LMHeadModel", "LlamaForCausalLM", "causal LMs whose config has base_model_pp_plan")


@dataclass
class LayerPlan:
    """One pipeline layer: its kind and its parts, each a recipe plus the HF module path it mirrors."""
    kind: str                                   # "embed", "block", "norm" or "head"
    parts: dict = field(default_factory=dict)   # local part name -> (recipe, HF module path)
    block: int | None = None                    # decoder block number, for kind == "block"

    def hf_name(self, local: str) -> str:
        """``tokens.weight`` -> ``transformer.wte.weight`` (by the part's HF path)."""
        part, _, rest = local.partition(".")
        if part not in self.parts:
            raise KeyError(f"{self.kind} layer has no part {part!r} (parts: {sorted(self.parts)})")
        return f"{self.parts[part][1]}.{rest}"


@dataclass
class Layout:
    """The pipeline layers of one HF causal LM, built from its config and module sizes."""
    model_class: str
    layers: list            # LayerPlan per global layer index
    tied: bool              # the head reuses the embedding's token weight
    config: object          # the HF config (blocks and masks are built from it)
    rotary: tuple | None    # recipe of the rotary embedding each block recomputes, or None
    dropout: float          # dropout after the embedding (GPT-2's embd_pdrop)

def _recipe(module: nn.Module, what: str, model_class: str) -> tuple:
    """(class, args, kwargs) that rebuilds ``module`` with fresh weights of the same shapes."""
    if type(module) is nn.Embedding:
        return (nn.Embedding, (module.num_embeddings, module.embedding_dim), {"padding_idx": module.padding_idx})
    if type(module) is nn.Linear:
        return (nn.Linear, (module.in_features, module.out_features), {"bias": module.bias is not None})
    if type(module) is nn.LayerNorm:
        return (nn.LayerNorm, (tuple(module.normalized_shape),),
                {"eps": module.eps, "elementwise_affine": module.elementwise_affine, "bias": module.bias is not None})
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    names = [n for n, _ in module.named_parameters()]
    if what == "norm" and weight is not None and weight.dim() == 1 and eps is not None and names == ["weight"]:
        return (type(module), (weight.shape[0],), {"eps": eps})      # RMSNorm-style: (hidden_size, eps=...)
    raise ValueError(f"cannot convert {model_class}: its {what} is a {type(module).__name__}, which ds_chimera.hf "
                     f"does not know how to rebuild (it handles nn.Embedding, nn.Linear, nn.LayerNorm and "
                     f"RMSNorm-style norms)")


def _block_recipe(block: nn.Module, config, index: int) -> tuple:
    return (type(block), (config,), {"layer_idx": index})


def describe(model) -> Layout:
    """The pipeline layout of ``model`` (a GPT-2, a Llama, or a causal LM with a pp_plan).

    Raises ValueError naming the model class when it cannot be converted.
    """
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "base_model_prefix"):
        raise ValueError(f"cannot convert {name}: not a transformers PreTrainedModel; supported: {', '.join(SUPPORTED)}")
    check_family(type(model), config)
    if name == "GPT2LMHeadModel":
        return _describe_gpt2(model)
    return _describe_pp_plan(model)


def check_family(model_class: type, config) -> None:
    """Refuse a model family the pipeline cannot cut, from the model's class and config alone.

    No instance is needed, so this runs before a model is built or its weights are loaded
    (:mod:`.early`); :func:`describe` then checks the modules themselves. Raises ValueError
    naming the class, the model type and the supported families.
    """
    name, family = model_class.__name__, getattr(config, "model_type", None) or type(config).__name__
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
        raise ValueError(f"cannot convert {name}: encoder-decoder / cross-attention models (model type {family!r}) "
                         f"are not supported; supported: {', '.join(SUPPORTED)}")
    if name != "GPT2LMHeadModel" and not getattr(config, "base_model_pp_plan", None):
        raise ValueError(f"cannot convert {name}: it is not GPT-2 or Llama and its config ({type(config).__name__}, "
                         f"model type {family!r}) has no base_model_pp_plan; supported: {', '.join(SUPPORTED)}")


def _tied(model) -> bool:
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    return head is not None and embed is not None and head.weight is embed.weight


def _describe_gpt2(model) -> Layout:
    name, config, base = type(model).__name__, model.config, model.transformer
    layers = [LayerPlan("embed", {"tokens": (_recipe(base.wte, "embedding", name), "transformer.wte"),
                                  "positions": (_recipe(base.wpe, "position embedding", name), "transformer.wpe")})]
    for i, block in enumerate(base.h):
        layers.append(LayerPlan("block", {"block": (_block_recipe(block, config, i), f"transformer.h.{i}")}, block=i))
    layers.append(LayerPlan("norm", {"norm": (_recipe(base.ln_f, "norm", name), "transformer.ln_f")}))
    tied = _tied(model)
    layers.append(LayerPlan("head", {} if tied else {"proj": (_recipe(model.lm_head, "head", name), "lm_head")}))
    return Layout(name, layers, tied, config, None, float(getattr(config, "embd_pdrop", 0.0)))


def _describe_pp_plan(model) -> Layout:
    """Embedding, block list, then norms, in the config's base_model_pp_plan order; the head from the class plan."""
    name, config = type(model).__name__, model.config
    prefix = model.base_model_prefix
    base = getattr(model, prefix, None)
    if base is None:
        raise ValueError(f"cannot convert {name}: it has no base model attribute {prefix!r}")
    plan = list(config.base_model_pp_plan.items())
    layers, seen_blocks = [], False
    for pos, (attr, (inputs, _outputs)) in enumerate(plan):
        module = getattr(base, attr, None)
        path = f"{prefix}.{attr}"
        if module is None:
            raise ValueError(f"cannot convert {name}: its pp_plan names {path!r}, which the model does not have")
        if pos == 0:
            if list(inputs) != ["input_ids"]:
                raise ValueError(f"cannot convert {name}: its pp_plan starts with {attr!r} taking {inputs}, "
                                 f"not an embedding of input_ids")
            layers.append(LayerPlan("embed", {"tokens": (_recipe(module, "embedding", name), path)}))
        elif isinstance(module, nn.ModuleList):
            if seen_blocks:
                raise ValueError(f"cannot convert {name}: its pp_plan has two block lists")
            seen_blocks = True
            for i, block in enumerate(module):
                layers.append(LayerPlan("block", {"block": (_block_recipe(block, config, i), f"{path}.{i}")}, block=i))
        else:
            if not seen_blocks:
                raise ValueError(f"cannot convert {name}: its pp_plan has {attr!r} between the embedding and the "
                                 f"blocks, which ds_chimera.hf does not support")
            layers.append(LayerPlan("norm", {"norm": (_recipe(module, "norm", name), path)}))
    heads = [k for k in (getattr(model, "_pp_plan", None) or {}) if not k.startswith(prefix + ".")]
    if not seen_blocks:
        raise ValueError(f"cannot convert {name}: its pp_plan has no list of decoder blocks")
    if len(heads) != 1:
        raise ValueError(f"cannot convert {name}: only causal LMs with one head in the class's pp_plan (such as "
                         f"lm_head) are supported; it has {heads or 'none'}")
    tied = _tied(model)
    head_module = model.get_submodule(heads[0])
    layers.append(LayerPlan("head", {} if tied else {"proj": (_recipe(head_module, "head", name), heads[0])}))
    rotary = getattr(base, "rotary_emb", None)
    rotary_recipe = (type(rotary), (), {"config": config}) if rotary is not None else None
    return Layout(name, layers, tied, config, rotary_recipe, 0.0)


def build(recipe: tuple) -> nn.Module:
    cls, args, kwargs = recipe
    return cls(*args, **kwargs)


def pipeline_hf_names(chunks, layout: Layout) -> dict:
    """id(parameter) -> HF parameter name, for the parameters of built pipeline chunks.

    A tied module's parameters are named after the embedding (its first use).
    """
    from ..runtime.chunks import layer_objects
    names = {}
    for chunk in chunks:
        for idx, obj in layer_objects(chunk).items():
            if not isinstance(obj, nn.Module):
                continue
            plan = layout.layers[0] if (layout.tied and layout.layers[idx].kind == "head") else layout.layers[idx]
            for local, param in obj.named_parameters():
                names.setdefault(id(param), plan.hf_name(local))
    return names
