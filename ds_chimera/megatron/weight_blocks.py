"""A split backward on Megatron chunks: each parameter-owning module's output is one weight-gradient block.

The executor's weight-gradient pass differentiates each block from its own output to its
own parameters (:func:`~ds_chimera.runtime.executor.split_input_grad`); here the blocks are
recorded during the forward and the parameters per-module W would get wrong are moved to
the input-gradient pass.
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_leaves


class BlockRecorder:
    """Records one chunk's weight-gradient blocks during its forwards: each parameter-owning module's output
    is one block. The weight-gradient pass then differentiates each module from its own output to its own
    parameters. Parameters no module owns directly get their gradients with the input gradients (a block
    without output), and so do parameters that the autograd graph shows used outside their module's recorded
    call (tied weights, a second call: :func:`settle_blocks`): per-module W would miss those uses.

    The chunk's modules are walked and hooked once, when it is made, and the hooks stay until :meth:`close`:
    the host makes one per chunk and call, so a Megatron chunk's hundreds of modules are not walked and
    hooked again on every micro-batch's forward. A hook records only inside :meth:`recording`.
    """

    def __init__(self, chunk):
        self.capture = self.nodes = None
        owners = [(m, list(m.parameters(recurse=False))) for m in chunk.modules()]
        self.handles = [m.register_forward_hook(self._hook(params)) for m, params in owners
                        if any(p.requires_grad for p in params)]

    def _hook(self, params: list):
        def record(module, args, output):
            capture = self.capture
            if capture is None:
                return
            trainable = [p for p in params if p.requires_grad]
            # graph outputs only: a parameter handed back (Megatron's skip_bias_add bias) is not one
            leaves = (output,) if isinstance(output, torch.Tensor) else tree_leaves(output)
            outs = tuple(t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None)
            if outs:
                capture.append((outs, trainable, tuple(t._version for t in outs)))
            else:
                capture.append((None, trainable))
            self.nodes.append(tuple(t.grad_fn for t in outs))
        return record

    @contextlib.contextmanager
    def recording(self, capture: list):
        """Record the blocks of the forward run inside into ``capture``; yields the per-block grad_fns
        :func:`settle_blocks` takes."""
        self.capture, self.nodes = capture, []
        try:
            yield self.nodes
        finally:
            self.capture = self.nodes = None

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def settle_blocks(chunk, capture: list, nodes: list, output) -> None:
    """Move every parameter per-module W would get wrong to the input-gradient pass.

    Walks the autograd graph from the chunk's output and from each block's output; a walk
    stops at other blocks' outputs. A parameter reached from the chunk's output, or from a
    block that does not own it, is used outside its owner's recorded output.
    """
    boundary = {}
    for i, grad_fns in enumerate(nodes):
        for node in grad_fns:
            if node is not None:
                boundary.setdefault(node, set()).add(i)
    used_elsewhere = set()

    def walk(starts, owner):
        stack, seen = list(starts), set()
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if node in boundary and owner not in boundary[node]:
                continue                                   # another block's output: its own walk covers it
            variable = getattr(node, "variable", None)      # AccumulateGrad: a parameter
            if variable is not None:
                if owner is None or id(variable) not in owned[owner]:
                    used_elsewhere.add(id(variable))
                continue
            stack.extend(next_node for next_node, _ in node.next_functions)

    owned = [{id(p) for p in block[1]} for block in capture]
    walk([t.grad_fn for t in tree_leaves(output) if isinstance(t, torch.Tensor)], None)
    for i, grad_fns in enumerate(nodes):
        starts = [next_node for node in grad_fns if node is not None for next_node, _ in node.next_functions]
        walk(starts, i)
    for i, block in enumerate(capture):
        if block[0] is not None and any(id(p) in used_elsewhere for p in block[1]):
            capture[i] = (block[0], [p for p in block[1] if id(p) not in used_elsewhere]) + tuple(block[2:])
    owned_ids = {id(p) for block in capture for p in block[1]}     # what moved out joins the unowned rest
    rest = [p for p in chunk.parameters() if p.requires_grad and id(p) not in owned_ids]
    if rest:
        capture.append((None, rest))
