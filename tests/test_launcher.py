"""``ds-chimera launch`` makes an unchanged script train with the configured schedule.

Each launched run's losses (and, for Wavelet, its weights) are compared with one-process
references written here, so that a launcher that starts the processes but trains the wrong
thing (no schedule, another schedule, other data or hyperparameters) fails. Synchronous
schedules all equal plain training; the asynchronous one equals the independent model of its
method (distributed/async_reference.py), whose losses differ from plain training's.
"""
import base64
import copy
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

import tiers

from netutil import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "distributed", "unchanged_script.py")
DP_SCRIPT = os.path.join(HERE, "distributed", "unchanged_dp_script.py")
sys.path.insert(0, os.path.join(HERE, "distributed"))
import async_reference  # noqa: E402

# what unchanged_script.py trains: 4 Linear(4, 4) layers seeded base_seed + index, 2 stages, SGD
STEPS, MICRO_BATCHES, BASE_SEED, LR = 4, 4, 1234, 0.1


def run(*args):
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, env=env)


def launch(*args):
    return run("-m", "ds_chimera.cli", "launch", "--torchrun", *args)


def reports(proc) -> list:
    """One dict per process: the KEY=VALUE fields of its ENGINE= report (JSON values where they parse),
    found anywhere in the output: the ranks share one pipe, and a report may follow another process's
    partial line or run into the next report."""
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = []
    for report in re.findall(r"ENGINE=.*?(?=ENGINE=|\n|$)", proc.stdout):
        fields = {}
        for item in report.split():
            key, _, value = item.partition("=")
            try:
                fields[key] = json.loads(value)
            except json.JSONDecodeError:
                fields[key] = value
        out.append(fields)
    return out


def pipeline_layers():
    layers = []
    for idx in range(4):
        torch.manual_seed(BASE_SEED + idx)
        layers.append(torch.nn.Linear(4, 4))
    return layers


def pipeline_batches(step):
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(1, 4, generator=g), torch.randn(1, 4, generator=g)) for _ in range(MICRO_BATCHES)]


def plain_training_losses(layers=None, steps=STEPS):
    """Every synchronous schedule: plain SGD on the mean loss of each call's micro-batches."""
    model = torch.nn.Sequential(*(layers or pipeline_layers()))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        batches = pipeline_batches(step)
        loss = sum(torch.nn.functional.mse_loss(model(x), y) for x, y in batches) / len(batches)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def async_model_losses(method):
    """An asynchronous schedule: the independent model of its method, one stage per rank."""
    layers = pipeline_layers()
    stages = [torch.nn.Sequential(*layers[:2]), torch.nn.Sequential(*layers[2:])]
    model = async_reference.AsyncReference(method, stages, lambda: async_reference.SGD(LR))
    return [model.train_call(pipeline_batches(step)) for step in range(STEPS)]


def assert_losses(got, want):
    assert len(got) == len(want) == STEPS
    assert all(abs(a - b) <= 1e-6 * abs(b) + 1e-7 for a, b in zip(got, want)), (got, want)


@pytest.mark.parametrize("schedule,engine", [("chimera", "ScheduledPipelineEngine")] +
                         ([("pipeoptim", "AsyncPipelineEngine")] if tiers.FULL else []))
def test_launch_trains_the_configured_schedule_without_code_changes(schedule, engine):
    proc = launch("--nproc_per_node", "2", "--master_port", str(free_port()), SCRIPT, schedule)
    ranks = reports(proc)
    assert len(ranks) == 2, proc.stdout[-3000:]
    if schedule == "pipeoptim":
        want = async_model_losses("pipeoptim")
        # the method's losses are its own: a launcher that ran plain 1F1B (or dropped the schedule) would differ
        assert max(abs(a - b) for a, b in zip(want, plain_training_losses())) > 1e-2
    else:
        want = plain_training_losses()
    for r in ranks:              # every rank reports the global mean loss of each call
        assert r["ENGINE"] == engine and r["SCHEDULE"] == schedule, r
        assert_losses(r["LOSSES"], want)


def test_without_the_launcher_deepspeed_is_untouched():
    """Plain torchrun: DeepSpeed's own PipelineEngine ignores the schedule key and trains plain 1F1B."""
    proc = run("-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), SCRIPT,
               "pipeoptim")
    ranks = reports(proc)
    assert len(ranks) == 2, proc.stdout[-3000:]
    for r in ranks:
        assert r["ENGINE"] == "PipelineEngine" and r["SCHEDULE"] is None, r
        assert_losses(r["LOSSES"], plain_training_losses())


def wavelet_reference(steps=3, lr=0.1):
    """Tick-tock data parallelism on one device: updates alternate between the tick task (rank 0) and the
    tock task (rank 1), each update's gradient computed on the weights one update older than the ones it
    is applied to: W(n+1) = W(n) - lr * g(W(n-1)), W(-1) = W(0). Returns (losses per rank, final weights)."""
    torch.manual_seed(0)                      # as unchanged_dp_script.py builds its model
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    history = [[p.detach().clone() for p in model.parameters()]]         # the weights after n updates
    losses = {0: [], 1: []}
    for n in range(2 * steps):
        rank, step = n % 2, n // 2
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        stale = copy.deepcopy(model)
        with torch.no_grad():
            for p, w in zip(stale.parameters(), history[max(n - 1, 0)]):
                p.copy_(w)
        loss = stale(x).pow(2).mean()
        loss.backward()
        losses[rank].append(loss.item())
        with torch.no_grad():
            for p, q in zip(model.parameters(), stale.parameters()):
                p -= lr * q.grad
        history.append([p.detach().clone() for p in model.parameters()])
    return losses, [p.detach().flatten().tolist() for p in model.parameters()]


def test_launch_wavelet_starts_two_tasks_per_device():
    proc = launch("--wavelet", "--nproc_per_node", "1", "--master_port", str(free_port()), DP_SCRIPT)
    # two tasks for one device (on CPU LOCAL_RANK is kept: DeepSpeed's shared-memory collectives key on it)
    tasks = reports(proc)
    assert sorted(t["RANK"] for t in tasks) == [0, 1], proc.stdout[-3000:]
    losses, weights = wavelet_reference()
    for t in tasks:
        assert t["ENGINE"] == "WaveletEngine", t
        got, want = t["LOSSES"], losses[t["RANK"]]
        assert len(got) == len(want) == 3 and all(abs(a - b) <= 1e-6 for a, b in zip(got, want)), (t["RANK"], got, want)
        flat = [v for tensor in t["WEIGHTS"] for v in tensor]
        ref = [v for tensor in weights for v in tensor]
        assert len(flat) == len(ref) == 25 and max(abs(a - b) for a, b in zip(flat, ref)) <= 1e-6


def test_launch_wavelet_needs_the_device_count():
    from ds_chimera.launch import double_processes
    assert double_processes(["--num_gpus", "2", "x.py"]) == (["--num_gpus", "4", "x.py"], 2)
    assert double_processes(["--nproc_per_node=3", "x.py"]) == (["--nproc_per_node=6", "x.py"], 3)
    proc = run("-m", "ds_chimera.cli", "launch", "--wavelet", "--torchrun", DP_SCRIPT)
    assert proc.returncode == 2 and "needs the number of devices per node" in proc.stderr


MULTINODE_SCRIPT = os.path.join(HERE, "distributed", "multinode_script.py")


def start_launch(*args):
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "ds_chimera.cli", "launch", "--torchrun", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(procs, timeout=300):
    """Wait for every launch; after ``timeout`` s in all, kill them (a node group left alone waits for its peer)."""
    out, deadline = [], time.monotonic() + timeout
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return out


def eight_layer_losses(steps=3):
    """multinode_script.py's training on one process: 8 Linear(4, 4) seeded base_seed + index, plain SGD."""
    layers = []
    for idx in range(8):
        torch.manual_seed(BASE_SEED + idx)
        layers.append(torch.nn.Linear(4, 4))
    return plain_training_losses(layers, steps)


@pytest.mark.skipif(not tiers.FULL, reason="35 s of CI's 10-minute budget; make test-full runs it (CI keeps the "
                                           "hostfile path's export test below)")
def test_two_node_groups_train_exactly_as_one():
    """`ds-chimera launch --torchrun --nnodes 2 --node_rank R` (static rendezvous on node 0's address), two
    groups of 2 processes on this machine, trains a 4-stage Chimera pipeline bit for bit as one group of 4."""
    port = free_port()
    nodes = [start_launch("--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "2", "--master_addr",
                          "127.0.0.1", "--master_port", str(port), MULTINODE_SCRIPT, "chimera") for node in (0, 1)]
    single = start_launch("--nnodes", "1", "--nproc_per_node", "4", "--master_port", str(free_port()),
                          MULTINODE_SCRIPT, "chimera")
    node0, node1, one = finish(nodes + [single])
    groups = [reports(node0), reports(node1)]
    for node, ranks in enumerate(groups):       # each node group ran ranks 2R, 2R+1 of one world of 4
        assert sorted((r["RANK"], r["LOCAL_RANK"], r["GROUP_RANK"], r["WORLD_SIZE"]) for r in ranks) == \
            [(2 * node + i, i, node, 4) for i in range(2)], ranks
    by_rank = {r["RANK"]: r for r in groups[0] + groups[1]}
    ref = {r["RANK"]: r for r in reports(one)}
    assert sorted(ref) == sorted(by_rank) == [0, 1, 2, 3], (sorted(ref), sorted(by_rank))
    want = eight_layer_losses()
    for rank in range(4):
        got, base = by_rank[rank], ref[rank]
        # the schedule switch reached both node groups' workers (the sitecustomize hook)
        assert got["ENGINE"] == base["ENGINE"] == "ScheduledPipelineEngine", (got["ENGINE"], base["ENGINE"])
        assert got["SCHEDULE"] == base["SCHEDULE"] == "chimera"
        assert got["LOSSES"] == base["LOSSES"], (rank, got["LOSSES"], base["LOSSES"])       # exact: float hex
        assert len(got["WEIGHTS"]) == 80 and got["WEIGHTS"] == base["WEIGHTS"], rank       # 2 chunks x 2 Linear(4, 4)
        losses = [float.fromhex(v) for v in got["LOSSES"]]
        assert len(losses) == 3 and all(abs(a - b) <= 1e-6 * abs(b) + 1e-7 for a, b in zip(losses, want)), \
            (losses, want)


FAKE_PDSH = """#!{python}
# stands in for pdsh: records the command it was given for the nodes, runs nothing
import json, os, sys
with open(os.environ["FAKE_PDSH_OUT"], "w") as fh:
    json.dump(sys.argv[1:], fh)
"""


def test_deepspeed_launcher_exports_ds_chimera_settings_to_every_node(tmp_path):
    """With a hostfile the deepspeed launcher starts each node's processes through pdsh (ssh), and a node
    gets only the variables the runner exports. A fake pdsh records the command; its exports, run by a
    shell in an empty environment as on a node reached by ssh, must carry the sitecustomize hook
    (PYTHONPATH) and the settings of --wavelet and --pipeline-schedule, JSON options intact."""
    from ds_chimera.launch import AUTOLOAD
    pdsh = tmp_path / "bin" / "pdsh"
    pdsh.parent.mkdir()
    pdsh.write_text(FAKE_PDSH.format(python=sys.executable))
    pdsh.chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=2\nnode-b slots=2\n")
    record = tmp_path / "pdsh.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DS_CHIMERA")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", FAKE_PDSH_OUT=str(record),
               PATH=f"{pdsh.parent}{os.pathsep}{os.environ['PATH']}")
    options = '{"chunks": 2}'
    proc = subprocess.run([sys.executable, "-m", "ds_chimera.cli", "launch", "--wavelet", "--pipeline-schedule",
                           "interleaved", "--pipeline-schedule-options", options, "--hostfile", str(hostfile),
                           "--no_ssh_check", "--master_addr", "127.0.0.1", "--num_gpus", "1", DP_SCRIPT],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    argv = json.loads(record.read_text())
    assert argv[:5] == ["-S", "-f", "1024", "-w", "node-a,node-b"], argv[:5]
    exports = argv[5]             # "export KEY=VALUE; ..." then the node's command
    assert "--node_rank=%n" in argv and argv[-1] == DP_SCRIPT, argv
    # --wavelet doubled the processes on each node of the hostfile
    world = next(a for a in argv if a.startswith("--world_info="))
    assert json.loads(base64.urlsafe_b64decode(world.split("=", 1)[1])) == {"node-a": [0, 1], "node-b": [0, 1]}
    probe = ("import json, os, sys; print(json.dumps({'hook': 'ds_chimera' in sys.modules, "
             "'env': {k: v for k, v in os.environ.items() if k.startswith('DS_CHIMERA')}}))")
    node = subprocess.run(["env", "-i", "/bin/sh", "-c", f"{exports} {sys.executable} -c \"{probe}\""],
                          capture_output=True, text=True, timeout=120)
    assert node.returncode == 0, node.stderr[-3000:]
    seen = json.loads(node.stdout.strip().splitlines()[-1])
    assert seen["hook"], (exports, node.stderr[-2000:])          # PYTHONPATH reached it, with the hook
    assert seen["env"] == {"DS_CHIMERA_WAVELET": "1", "DS_CHIMERA_DEVICES_PER_NODE": "1",
                           "DS_CHIMERA_PIPELINE_SCHEDULE": "interleaved",
                           "DS_CHIMERA_PIPELINE_OPTIONS": options}, exports
    assert AUTOLOAD in exports


SHM_SCRIPT = r"""
import os, sys
import deepspeed
deepspeed.init_distributed(dist_backend="gloo")
import torch.distributed as dist
names = [n for n in os.listdir("/dev/shm") if n.startswith("deepspeed_allreduce_buffer_") and
         n.rsplit("_", 2)[-2] == os.environ["MASTER_PORT"]]
print(f"RANK{dist.get_rank()} BUFFERS={len(names)}", flush=True)
dist.barrier()
"""


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this host: nothing to leave behind")
def test_a_launch_leaves_no_shared_memory_buffer_behind(tmp_path):
    """DeepSpeed's CPU accelerator makes a ~70 MB /dev/shm buffer per rank under its launcher and never removes
    it; the job sees them (so the check below means something), and after the launch none is left."""
    script = tmp_path / "shm.py"
    script.write_text(SHM_SCRIPT)
    port = str(free_port())
    proc = run("-m", "ds_chimera.cli", "launch", "--num_gpus", "2", "--master_port", port, str(script))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    seen = sorted(set(re.findall(r"RANK\d BUFFERS=(\d+)", proc.stdout)))
    assert seen and all(int(n) >= 1 for n in seen), proc.stdout[-2000:]
    left = [n for n in os.listdir("/dev/shm") if n.startswith("deepspeed_allreduce_buffer_") and
            n.rsplit("_", 2)[-2] == port]
    assert left == []


def test_the_launcher_removes_only_its_jobs_shared_memory_buffers(tmp_path):
    from ds_chimera.launch import master_port, remove_shm_buffers
    assert master_port(["--nproc_per_node", "2", "--master_port", "1234", "x.py"]) == "1234"
    assert master_port(["--master-port=4321", "x.py"]) == "4321"
    assert master_port(["--num_gpus", "4", "x.py", "--master_port", "9"]) == "29500"    # the script's own argument
    assert master_port(["x.py"]) == "29500"
    assert master_port(["--standalone", "--nproc_per_node", "2", "x.py"]) is None      # chosen at run time
    assert remove_shm_buffers(None, 0.0, folder=str(tmp_path)) == []
    uid = os.getuid()
    mine = [f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_1234_{rank}" for rank in range(2)]
    others = [f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_1235_0",      # another job's port
              f"deepspeed_allreduce_buffer_{uid + 1}_127.0.0.1_1234_0",  # another user's
              "unrelated_1234_0"]
    old = f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_1234_7"          # an earlier job on the same port
    for name in mine + others + [old]:
        (tmp_path / name).write_bytes(b"x")
    os.utime(tmp_path / old, (time.time() - 3600, time.time() - 3600))
    since = time.time() - 10
    removed = remove_shm_buffers("1234", since, folder=str(tmp_path))
    assert sorted(removed) == sorted(mine)
    assert sorted(os.listdir(tmp_path)) == sorted(others + [old])
