"""What sharded data parallelism costs the host's CPU: per collective, and per step of zero.py's rows.

    python tools/zero_cpu.py                                  # breadth-first and interleaved, ZeRO-1 and 3, N = 8
    python tools/zero_cpu.py --rows interleaved:3 --micro-batches 4 --ballast-mib 8

Four CPU ranks (gloo) and ``benchmarks/zero.py``'s model: 2 stages x 2 data-parallel, 4 chunks per rank,
``--op-ms`` per op, ``--ballast-mib`` of weights per chunk. First each data-parallel pair runs 200
all-gathers and 200 reduce-scatters of one chunk, and each rank prints the CPU one collective costs it
(user and system time from getrusage, every thread of the process). Then each row runs one warm-up and
6 timed steps; per rank and step it prints the wall time, the CPU time, its user and system parts, the
involuntary context switches and the minor page faults. On a host with fewer cores than ranks, the CPU
a row needs beyond another row's is time the ranks queue for cores, which the simulator (one device per
rank) does not model: ``docs/investigations/zero3-simulator-gap.md``.
"""
import argparse
import os
import resource
import statistics
import sys
import time

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")
sys.path.insert(0, BENCHMARKS)
from harness import (COST_S, collective_buffers, launch, report, save_rows, share_one_device,  # noqa: E402
                     timed_collective)
from zero import build_engine, chunk_numel, data_parallel_group, make_batches, row_arg, timed_specs  # noqa: E402

ROUNDS = 200
STEPS = 6


def usage() -> tuple:
    """(user s, system s, involuntary switches, minor faults) of this process so far."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime, u.ru_stime, u.ru_nivcsw, u.ru_minflt


def spent(before: tuple, after: tuple, count: int) -> dict:
    user, system, switches, faults = ((b - a) / count for a, b in zip(before, after))
    return {"user_ms": user * 1e3, "system_ms": system * 1e3, "switches": switches, "faults": faults}


def worker(args):
    import torch
    import torch.distributed as dist

    import deepspeed
    import ds_chimera  # noqa: F401

    share_one_device()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    numel = int(args.ballast_mib * 2 ** 20 / 4)
    pair = data_parallel_group(dist)
    rows = []
    full, shard = collective_buffers(dist, torch, pair, chunk_numel(numel))
    for kind, name in (("all_gather", "gather"), ("reduce_scatter", "reduce_scatter")):
        for _ in range(5):
            timed_collective(dist, pair, name, full, shard)
        dist.barrier()
        before, start = usage(), time.perf_counter()
        for _ in range(ROUNDS):
            timed_collective(dist, pair, name, full, shard)
        row = {"collective": kind, "rank": rank, "mib": full.numel() * 4 / 2 ** 20,
               "wall_ms": (time.perf_counter() - start) / ROUNDS * 1e3, **spent(before, usage(), ROUNDS)}
        rows.append(row)
        print(f"  cpu {kind} of {row['mib']:.1f} MiB, rank {rank}: wall {row['wall_ms']:.2f} ms, user "
              f"{row['user_ms']:.2f} ms, system {row['system_ms']:.2f} ms per collective", flush=True)
    specs = timed_specs(args.op_ms / 1e3, numel)
    for schedule, zero in args.rows:
        engine, data = build_engine(specs, schedule, zero, args.micro_batches), make_batches(args.micro_batches)
        engine.train_batch(iter(data))
        walls, cpus, before = [], [], usage()
        for _ in range(STEPS):
            dist.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            engine.train_batch(iter(data))
            walls.append(time.perf_counter() - start)
            cpus.append(time.process_time() - cpu)
        row = {"schedule": schedule, "zero": zero, "N": args.micro_batches, "rank": rank,
               "step_ms": statistics.mean(walls) * 1e3, "cpu_ms": statistics.mean(cpus) * 1e3,
               **spent(before, usage(), STEPS)}
        rows.append(row)
        print(f"  cpu {schedule} ZeRO-{zero} N={args.micro_batches}, rank {rank}: step {row['step_ms']:.1f} ms, "
              f"CPU {row['cpu_ms']:.1f} ms ({row['cpu_ms'] / row['step_ms']:.0%}; user {row['user_ms']:.1f}, "
              f"system {row['system_ms']:.1f}), involuntary switches {row['switches']:.0f}, minor faults "
              f"{row['faults']:.0f}", flush=True)
        del engine
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, rows)          # every rank's rows into rank 0's file
    save_rows(dist, [row for part in every for row in part], args.out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--rows", type=row_arg, nargs="+", default=[("breadth-first", 1), ("breadth-first", 3),
                                                                   ("interleaved", 1), ("interleaved", 3)])
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--op-ms", type=float, default=COST_S * 1e3)
    parser.add_argument("--ballast-mib", type=float, default=2.0)
    parser.add_argument("--out", default="/tmp/zero_cpu.json")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.micro_batches < 1 or not args.op_ms > 0 or not args.ballast_mib > 0:
        parser.error("--micro-batches must be >= 1 and --op-ms, --ballast-mib > 0")
    worker_args = ["--micro-batches", args.micro_batches, "--op-ms", args.op_ms, "--ballast-mib", args.ballast_mib,
                   "--rows", *(f"{s}:{z}" for s, z in args.rows)]
    return report(launch(__file__, worker_args, args.out, ("  cpu",)))


if __name__ == "__main__":
    sys.exit(main() or 0)
