"""``ds-chimera launch`` makes an unchanged script use the configured schedule."""
import os
import subprocess
import sys

from netutil import free_port

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed", "unchanged_script.py")


def run(*args):
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "ds_chimera.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_launch_enables_the_schedule_without_code_changes():
    proc = run("launch", "--torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), SCRIPT, "chimera")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ENGINE=ScheduledPipelineEngine") == 2


def test_without_the_launcher_deepspeed_is_untouched():
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(free_port()), SCRIPT, "chimera"], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ENGINE=PipelineEngine") == 2


DP_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed", "unchanged_dp_script.py")


def test_launch_wavelet_starts_two_tasks_per_device():
    proc = run("launch", "--wavelet", "--torchrun", "--nproc_per_node", "1", "--master_port", str(free_port()),
               DP_SCRIPT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # two tasks for one device (on CPU LOCAL_RANK is kept: DeepSpeed's shared-memory collectives key on it)
    assert proc.stdout.count("ENGINE=WaveletEngine") == 2


def test_launch_wavelet_needs_the_device_count():
    from ds_chimera.launch import double_processes
    assert double_processes(["--num_gpus", "2", "x.py"]) == (["--num_gpus", "4", "x.py"], 2)
    assert double_processes(["--nproc_per_node=3", "x.py"]) == (["--nproc_per_node=6", "x.py"], 3)
    proc = run("launch", "--wavelet", "--torchrun", DP_SCRIPT)
    assert proc.returncode == 2 and "needs the number of devices per node" in proc.stderr
