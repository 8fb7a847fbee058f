"""One rank fails while ``"schedule": "auto"`` profiles on a tensor-parallel topology (T = 2, P = 2, 4 ranks).

    python auto_profile_fault_worker.py OUT VICTIM FAULT WHEN   # started as plain processes by tests/test_setup_faults.py

Rank 0 and its tensor peer (rank 1) time the layers together inside ``deepspeed.initialize`` (WHEN ``initialize``:
it is given ``training_data``) or at the first ``train_batch`` (WHEN ``first-call``: it is not): a tensor-parallel
block all-reduces its row-parallel output, so when one of them fails in a block the other waits in that
all-reduce, and ranks 2 and 3 wait for the profile. VICTIM fails in its second block's forward the first time it
runs it (the profiler's run): FAULT ``raise`` (a RuntimeError) or ``kill`` (the process dies). It writes
``OUT/fault.json`` (the time) first; every rank that catches ``initialize``'s exception writes
``OUT/caught-rank{R}.json`` (its type, message and time) and ends normally, the victim after LINGER_S (a script
that goes on after its error, to report or save: its process's end must not be what frees the others).
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import deepspeed
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

import ds_chimera  # noqa: F401  (installs the "pipeline" key)
from ds_chimera.nn.tensor_parallel import TensorGroup, TensorParallelMLP

WIDTH, HIDDEN, LAYERS, MICRO, N = 8, 16, 4, 2, 4
LINGER_S = 12.0         # beyond the test's bound: the others must end before the victim's process does
OUT, VICTIM, FAULT, WHEN = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]


class FailingBlock(TensorParallelMLP):
    """A tensor-parallel block whose ``seed == 1`` copy fails on VICTIM the first time it runs."""

    def __init__(self, *args, seed: int, **kwargs):
        super().__init__(*args, seed=seed, **kwargs)
        self.fails = seed == 1 and dist.get_rank() == VICTIM

    def forward(self, x):
        if self.fails:
            with open(os.path.join(OUT, "fault.json"), "w") as fh:
                json.dump({"time": time.time(), "rank": VICTIM}, fh)
            if FAULT == "kill":
                os._exit(9)
            raise RuntimeError(f"injected failure on rank {VICTIM} while the layers are profiled")
        return super().forward(x)


def main():
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    topology = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)
    group = TensorGroup.of_topology(topology)
    net = PipelineModule(layers=[LayerSpec(FailingBlock, WIDTH, group, seed=i, hidden=HIDDEN) for i in range(LAYERS)],
                         topology=topology, loss_fn=nn.MSELoss(), partition_method="uniform")
    data = torch.utils.data.TensorDataset(torch.randn(N * MICRO, WIDTH), torch.randn(N * MICRO, WIDTH))
    cfg = {"train_batch_size": N * MICRO, "train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 1000,
           "pipeline": {"schedule": "auto", "timeout": 20}}
    try:
        engine = deepspeed.initialize(model=net, config=cfg, training_data=data if WHEN == "initialize" else None,
                                      optimizer=lambda p: torch.optim.SGD(p, lr=0.01))[0]
        if WHEN == "first-call":
            engine.train_batch(iter(list(zip(data.tensors[0].split(MICRO), data.tensors[1].split(MICRO)))))
    except Exception as exc:         # noqa: BLE001  (what the script sees, written for the test)
        with open(os.path.join(OUT, f"caught-rank{rank}.json"), "w") as fh:
            json.dump({"type": type(exc).__name__, "message": str(exc), "time": time.time()}, fh)
        if rank == VICTIM:
            time.sleep(LINGER_S)
        return
    print(f"rank {rank}: the profile ran", flush=True)


if __name__ == "__main__":
    main()
