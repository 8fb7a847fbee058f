"""4 gloo ranks check the runtime's all-reduce (``ds_chimera.runtime.allreduce``).

Prints one JSON line per rank: the checks it made and their outcomes. Started by
tests/test_allreduce_exchange.py as plain processes (``netutil.run_ranks``).
"""
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from ds_chimera.runtime.allreduce import (EXCHANGE_MAX_BYTES, ExchangeAllReduce, allreduce_async,
                                          uses_exchange)
from ds_chimera.runtime.gradsync import FlatGradAllReduce
from ds_chimera.runtime.p2p import PeerTimeout


def contribution(rank: int, shape, dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {"world": (list(range(world)), None), "pair 0-3": ([0, 3], dist.new_group([0, 3])),
              "pair 1-2": ([1, 2], dist.new_group([1, 2]))}
    report = {"rank": rank, "cases": []}
    seed = 0
    for name, (members, group) in groups.items():
        for shape, dtype in [((), torch.float64), ((1,), torch.float32), ((1000,), torch.float32),
                             ((7, 5), torch.bfloat16)]:
            seed += 1
            if rank not in members:
                continue
            mine = contribution(rank, shape, dtype, seed)
            ours, ring = mine.clone(), mine.clone()
            work = allreduce_async(ours, group, "a test all-reduce", key=seed)
            dist.all_reduce(ring, group=group)
            work.wait(timedelta(seconds=30))
            expected = sum(contribution(r, shape, torch.float64, seed).to(dtype).double() for r in members)
            gathered = [torch.empty_like(ours) for _ in members]
            dist.all_gather(gathered, ours, group=group)
            report["cases"].append({
                "group": name, "shape": list(shape), "dtype": str(dtype),
                "exchange": isinstance(work, ExchangeAllReduce),
                "err_vs_exact": float((ours.double() - expected).abs().max()),
                "err_vs_ring": float((ours.double() - ring.double()).abs().max()),
                "members_bitwise_equal": all(torch.equal(g, gathered[0]) for g in gathered),
            })
    # several syncs in flight on one group, finished in the reverse order of posting
    grads = [[contribution(rank, (3,), torch.float32, 100 + k)] for k in range(3)]
    syncs = [FlatGradAllReduce(g, None, f"stage {k}", key=k) for k, g in enumerate(grads)]
    for sync in reversed(syncs):
        sync.finish(30.0, divide_by=world)
    report["in_flight_err"] = max(
        float((g[0].double() - sum(contribution(r, (3,), torch.float32, 100 + k).double()
                                   for r in range(world)) / world).abs().max())
        for k, g in enumerate(grads))
    big = torch.ones(EXCHANGE_MAX_BYTES // 4 + 1)
    report["small_uses_exchange"] = uses_exchange(torch.ones(4))
    report["big_uses_exchange"] = uses_exchange(big)
    work = allreduce_async(big, None)
    work.wait()
    report["big_is_ring_work"] = not isinstance(work, ExchangeAllReduce)
    report["big_sum_ok"] = bool((big == world).all())
    # a peer that never posts: the others fail with the runtime's clear error, in bounded time
    dist.barrier()
    if rank != world - 1:
        sync = FlatGradAllReduce([torch.ones(2)], None, "stage 9", key=9)
        try:
            sync.finish(2.0)
            report["missing_peer"] = "finished"
        except PeerTimeout as exc:
            report["missing_peer"] = str(exc)
    print(json.dumps(report), flush=True)
    sys.stdout.flush()
    os._exit(0)        # the silent rank's exchange stays unmatched: leave without tearing down gloo


if __name__ == "__main__":
    main()
