"""What a message between pipeline neighbours and a data-parallel all-reduce cost on this job's ranks.

Measured with torch.distributed on the job's own process groups (gloo on CPU, NCCL on GPU):

- point-to-point, between the global ranks of stages 0 and 1: the one-way time of a small
  message (half a ping-pong, or to a receiver that has waited, whichever is longer; median),
  the bandwidth from a ping-pong of ``big_bytes``, and the
  sender's and receiver's own host time per message (posting a send; taking a message that has
  arrived), which the runtime pays per message and the simulator prices as ``send``/``recv``;
- the all-reduce over the data-parallel group (when it has more than one member, else over
  those two ranks: Chimera's replicas sync in pairs), small and big, as a step meets it: every member
  but the last waiting for it, the last posting after an idle (:func:`sync_after_wait`);
- with ``host_cost``, the runtime's host time per compute action, every rank measuring at once (the mean):
  the simulator's ``dispatch``. The entry points pass the runtime's measurement in
  (``runtime.host_cost.measure_dispatch``); the planner does not import the runtime.

Every rank of the world must call :func:`measure_links`; the result is the same on every rank.
"""
from __future__ import annotations

import socket
import statistics
import time

import torch

from .profile import Links


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ping_pong(dist, me, peer, first: bool, tensor, rounds: int, device) -> float:
    """Median one-way time of ``tensor`` between ``me`` and ``peer`` (half a round trip)."""
    times = []
    for _ in range(rounds):
        _sync(device)
        start = time.perf_counter()
        if first:
            dist.send(tensor, peer)
            dist.recv(tensor, peer)
        else:
            dist.recv(tensor, peer)
            dist.send(tensor, peer)
        _sync(device)
        times.append((time.perf_counter() - start) / 2)
    return statistics.median(times)


def _host_costs(dist, first: bool, peer, device, rounds: int) -> tuple:
    """(sender's time to post one isend, receiver's time to take one arrived message)."""
    small = torch.zeros(16, device=device)
    posts, takes = [], []
    for _ in range(rounds):
        if first:
            start = time.perf_counter()
            work = dist.isend(small, peer)
            posts.append(time.perf_counter() - start)
            work.wait()
        else:
            time.sleep(0.001)      # the message has arrived by now; take it
            start = time.perf_counter()
            dist.recv(small, peer)
            takes.append(time.perf_counter() - start)
    return (statistics.median(posts) if posts else 0.0), (statistics.median(takes) if takes else 0.0)


def _waiting_latency(dist, first: bool, peer, device, idle_s: float, rounds: int) -> float:
    """Median one-way time to a receiver that has been blocked ``idle_s`` (the pipeline's critical path runs
    through ranks waiting for their input, and a thread that has slept wakes more slowly than one in a
    ping-pong loop). The sender stamps the message with its clock (one clock on a host; across hosts the
    figure is half a round trip after the wait instead)."""
    stamp = torch.zeros(1, dtype=torch.float64, device=device)
    delays = []
    for _ in range(rounds):
        if first:
            time.sleep(idle_s)
            _sync(device)
            stamp[0] = time.perf_counter()
            dist.send(stamp, peer)
        else:
            dist.recv(stamp, peer)
            _sync(device)
            delays.append(time.perf_counter() - float(stamp[0]))
    return statistics.median(delays) if delays else 0.0


def _bandwidth(nbytes: int, big_s: float, small_s: float) -> float:
    """Bytes per second from the times of a big and a small transfer; 0 (sizes not priced) where the big one
    is not measurably slower (under 5% more): a difference in the noise would give any bandwidth at all."""
    extra = big_s - small_s
    return nbytes / extra if extra > 0.05 * small_s else 0.0


def measure_links(dist, first_rank: int, second_rank: int, data_group, device, big_bytes: int = 1 << 20,
                  rounds: int = 30, idle_s: float = 0.005, same_host: bool = True, reduce_bytes: int = 1 << 20,
                  pipe_group=None, host_cost=None) -> Links:
    """Links measured between global ranks ``first_rank`` and ``second_rank``; the all-reduce over
    ``data_group`` where it has several members, else over those two ranks (Chimera's stage replicas
    sync over such pairs). Every rank calls it; the result is the same on every rank.

    ``idle_s``: how long a receiver waits for its input in a step (a stage's forward): the latency
    priced is the one to such a waiting rank where both ranks share a host (``same_host``, and their host names
    agree); a gradient sync's last member idles as long before it posts.
    ``big_bytes`` (a message) and ``reduce_bytes`` (a stage's gradients) size the bandwidth probes.
    ``pipe_group`` (the pipeline ranks of a data-parallel copy, more than two): the all-reduce over it too,
    for schedules whose stages have more than two replicas (Chimera with several pipelines).
    ``host_cost``: a callable returning this rank's host time per compute action (seconds), called on every
    rank at once after the messages are measured."""
    me = dist.get_rank()
    values = torch.zeros(10, dtype=torch.float64, device=device)
    big = max(4, int(big_bytes) // 4)
    reduce_numel = max(4, int(reduce_bytes) // 4)
    pair = dist.new_group(sorted({first_rank, second_rank}))     # collective: every rank, in one order
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    same_host = same_host and hosts[first_rank] == hosts[second_rank]    # one clock for the waiting latency's stamps
    dist.barrier()
    if me in (first_rank, second_rank) and first_rank != second_rank:
        first = me == first_rank
        peer = second_rank if first else first_rank
        small = torch.zeros(16, device=device)
        _ping_pong(dist, me, peer, first, small, 5, device)            # warm-up: connections, buffers
        latency = _ping_pong(dist, me, peer, first, small, rounds, device)
        large = torch.zeros(big, device=device)
        big_s = _ping_pong(dist, me, peer, first, large, max(5, rounds // 3), device)
        send_s, recv_s = _host_costs(dist, first, peer, device, rounds)
        waiting = _waiting_latency(dist, first, peer, device, idle_s, max(5, rounds // 2)) if same_host else 0.0
        if first:
            values[1] = _bandwidth(big * 4, big_s, latency)
            values[2] = send_s
        else:
            values[0] = max(latency, waiting)
            values[3] = recv_s
    dist.barrier()
    dp = dist.get_world_size(data_group) if data_group is not None else 1
    narrow = data_group if dp > 1 else pair
    if dist.get_world_size(narrow) > 1 and (dp > 1 or me in (first_rank, second_rank)):
        lat, bw, post = _allreduce_times(dist, narrow, reduce_numel, rounds, device, idle_s, hosts)
        if me == first_rank:
            values[4], values[5], values[8] = lat, _bandwidth(reduce_numel * 4, bw, lat), post
    dist.barrier()
    if pipe_group is not None and dist.get_world_size(pipe_group) > 2 and \
            dist.get_rank(pipe_group) >= 0 and dp == 1:
        lat, bw, _ = _allreduce_times(dist, pipe_group, reduce_numel, rounds, device, idle_s, hosts)
        if me == first_rank:
            values[6], values[7] = lat, _bandwidth(reduce_numel * 4, bw, lat)
    dist.barrier()
    if host_cost is not None:
        values[9] = host_cost() / dist.get_world_size()      # summed below: the mean over the ranks
    dist.all_reduce(values)            # each figure was written by one rank, zeros elsewhere (but the mean)
    dist.destroy_process_group(pair)
    v = [float(x) for x in values.cpu()]
    return Links(p2p_latency_s=v[0], p2p_bytes_per_s=v[1], send_s=v[2], recv_s=v[3], allreduce_latency_s=v[4],
                 allreduce_bytes_per_s=v[5], wide_allreduce_latency_s=v[6] or v[4],
                 wide_allreduce_bytes_per_s=v[7] if v[6] else v[5], sync_post_s=v[8], dispatch_s=v[9])


def _members(dist, group) -> list:
    """The global ranks of ``group`` (None: the world)."""
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def sync_after_wait(dist, group, numel: int, idle_s: float, rounds: int, device, same_host=None) -> tuple:
    """Median times of a stage's gradient sync over ``group`` as a step meets it: (from its last member's post
    to the moment every member holds the result, the last member's own time to post it).

    A sync completes only after its last member posts it, and the others are waiting by then: every member but
    the last posts at once and waits; the last one idles ``idle_s`` first (a rank finishing its last backward),
    then flattens the gradients (``numel`` floats in two tensors), posts the all-reduce and waits, and each
    member copies the result back, as the runtime does. Where the members share a host (``same_host``; None:
    they compare host names) each stamps its result's arrival on the one clock (``time.perf_counter``); across
    hosts, whose clocks differ, the time is the last member's own, from its post to its result. Every member
    of ``group`` (None: the world) calls it; its barriers and the stamps' reduction stay within the group."""
    members = _members(dist, group)
    last = dist.get_rank() == max(members)
    if same_host is None:
        hosts = [None] * len(members)
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        same_host = len(set(hosts)) == 1
    grads = [torch.zeros(max(1, numel // 2), device=device), torch.zeros(max(1, numel - numel // 2), device=device)]
    times, posts = [], []
    for _ in range(rounds):
        dist.barrier(group=group)
        if last:
            time.sleep(idle_s)
        _sync(device)
        posted = time.perf_counter()
        flat = torch.cat(grads)
        work = dist.all_reduce(flat, group=group, async_op=True)
        returned = time.perf_counter()
        work.wait()
        for grad, synced in zip(grads, flat.split([g.numel() for g in grads])):
            grad.copy_(synced)
        _sync(device)
        done = time.perf_counter()
        if same_host:
            stamps = [posted if last else 0.0, returned - posted if last else 0.0, done]
        else:
            stamps = [0.0, returned - posted if last else 0.0, done - posted if last else 0.0]
        stamps = torch.tensor(stamps, dtype=torch.float64, device=device)
        dist.all_reduce(stamps, op=dist.ReduceOp.MAX, group=group)
        times.append(float(stamps[2] - stamps[0]))
        posts.append(float(stamps[1]))
    return statistics.median(times), statistics.median(posts)


def _allreduce_times(dist, group, numel: int, rounds: int, device, idle_s: float, hosts: list) -> tuple:
    """(a small gradient sync over ``group``, one of ``numel`` floats, the post of the latter), as a step meets
    them (:func:`sync_after_wait`). ``hosts``: every global rank's host name, already gathered."""
    for _ in range(3):
        dist.all_reduce(torch.zeros(16, device=device), group=group)        # warm-up: connections, buffers
    same_host = len({hosts[r] for r in _members(dist, group)}) == 1
    small, _ = sync_after_wait(dist, group, 16, idle_s, rounds, device, same_host)
    big, post = sync_after_wait(dist, group, numel, idle_s, max(5, rounds // 3), device, same_host)
    return small, big, post
