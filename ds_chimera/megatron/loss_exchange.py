"""The hand-over of per-micro-batch results to the last pipeline rank, where Megatron's training loop reads them.

A schedule may compute losses elsewhere (Chimera on two ranks, zbv's last stage on rank 0),
so the loss ranks send theirs to rank D-1: sizes first (overlapping Megatron's gradient
finalisation), then the pickled results. Tensors that arrive are detached: they cannot
carry a graph across ranks.
"""
from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

from ..runtime.p2p import LOSS_TAG, post_or_fail, wait_or_fail
from ..runtime.tensors import map_tensors, to_device


def start_loss_exchange(reduced: dict, placement, group, device, rank: int, timeout_s: float):
    """Post the hand-over of ``reduced`` (micro-batch -> what this rank's ``loss_func`` reported) to
    the last pipeline rank; return a function that finishes it and gives every loss rank's results
    in micro-batch order there (``[]`` on every other rank), as Megatron's schedules do."""
    loss_ranks = sorted({placement.rank_of(c.index) for c in placement.chunks
                         if placement.next_chunk(c.index) is None})
    last = placement.num_ranks - 1
    senders = [r for r in loss_ranks if r != last]
    local = lambda: [reduced[mb] for mb in sorted(reduced)]      # noqa: E731
    if rank != last and rank not in senders:
        return list
    if not senders:
        return local
    # CPU copies travel: pickled device tensors would be rebuilt on the sender's device index
    on = device if dist.get_backend(group) != "gloo" else torch.device("cpu")
    peer = (lambda r: r) if group is None or group is dist.group.WORLD else \
        (lambda r: dist.get_global_rank(group, r))
    what = "the loss results for the last pipeline rank"
    if rank != last:
        payload = torch.frombuffer(bytearray(pickle.dumps(map_tensors(reduced, lambda t: t.detach().cpu()))),
                                   dtype=torch.uint8).to(on)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=on)
        works = [post_or_fail(lambda: dist.isend(size, peer(last), group=group, tag=LOSS_TAG), what),
                 post_or_fail(lambda: dist.isend(payload, peer(last), group=group, tag=LOSS_TAG + 1), what)]

        def sent() -> list:
            for work in works:
                wait_or_fail(work, timeout_s, what)
            return []
        return sent
    sizes = {r: torch.zeros(1, dtype=torch.int64, device=on) for r in senders}
    size_works = {r: post_or_fail(lambda r=r: dist.irecv(sizes[r], peer(r), group=group, tag=LOSS_TAG),
                                  f"the size of rank {r}'s loss results") for r in senders}

    def finish() -> list:
        merged = dict(reduced)
        for r in senders:
            wait_or_fail(size_works[r], timeout_s, f"the size of pipeline rank {r}'s loss results")
            data = torch.empty(int(sizes[r].item()), dtype=torch.uint8, device=on)
            wait_or_fail(lambda: dist.irecv(data, peer(r), group=group, tag=LOSS_TAG + 1), timeout_s,
                         f"the loss results of pipeline rank {r}")
            merged.update(pickle.loads(data.cpu().numpy().tobytes()))
        return [to_device(merged[mb], device) for mb in sorted(merged)]
    return finish
