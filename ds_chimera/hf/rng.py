"""A random stream for the pipeline's compute, apart from the one the Trainer's data side draws from.

Every rank collates the same batches itself, so a collator or sampler that draws random
numbers must draw the same ones on every rank. The ranks' compute differs (each builds and
runs other stages, with dropout), so it runs on its own per-rank stream, swapped in around
engine work; the global stream then advances on every rank exactly as the data side uses it.
"""
from __future__ import annotations

import contextlib

import torch


class ComputeRNG:
    def __init__(self, seed: int, rank: int):
        self.seed = (seed * 1_000_003 + 7919 * (rank + 1)) % (2 ** 63)
        self.cpu = torch.Generator().manual_seed(self.seed).get_state()
        self.cuda = None

    @contextlib.contextmanager
    def active(self):
        data_cpu = torch.get_rng_state()
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        data_cuda = torch.cuda.get_rng_state() if cuda else None
        torch.set_rng_state(self.cpu)
        if cuda:
            if self.cuda is None:
                torch.cuda.manual_seed(self.seed)
            else:
                torch.cuda.set_rng_state(self.cuda)
        try:
            yield
        finally:
            self.cpu = torch.get_rng_state()
            torch.set_rng_state(data_cpu)
            if cuda:
                self.cuda = torch.cuda.get_rng_state()
                torch.cuda.set_rng_state(data_cuda)

    def state_dict(self) -> dict:
        return {"cpu": self.cpu, "cuda": self.cuda}

    def load_state_dict(self, state: dict) -> None:
        self.cpu, self.cuda = state["cpu"], state.get("cuda")
