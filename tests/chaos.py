"""The chaos harness: 4 ranks started without a launcher, one of them failing on purpose.

A case is (engine, victim rank, point, fault). The fault phase runs the ranks of
``distributed/chaos_worker.py`` as plain processes (no launcher kills the survivors, as
on other nodes) and measures, from the moment the victim fails, when each survivor
exits and what it says. The resume phase restarts all four from the last complete
checkpoint and trains to the end. :func:`check_case` asserts what the issue asks: every
survivor ends within the bound (raise and kill: 10 s; stop: timeout + 5 s), names the
victim, the checkpoint loads, resuming reproduces the uninterrupted run, and no
interrupted save is left behind.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass

from netutil import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "distributed", "chaos_worker.py")
ENGINES = ("1f1b", "chimera", "zbv", "pipeoptim", "wavelet")
POINTS = ("forward", "backward", "send", "receive", "sync", "step", "save")
FAULTS = ("raise", "kill", "stop")
WORLD = 4
# points an engine never passes in these runs: the asynchronous engine at 4 x 1 has no data
# parallelism, so no gradient sync (the synchronous programs always end with one)
ABSENT = {("pipeoptim", "sync")}


@dataclass(frozen=True)
class Case:
    engine: str
    victim: int
    point: str
    fault: str
    timeout: float = 8.0
    monitor: bool = True       # False: DS_CHIMERA_FAULT_MONITOR=0, the bounded waits alone end the job
    catch: bool = False        # every rank catches train_batch's exception and ends normally
    recover: bool = False      # ... and then builds a new engine, loads the latest checkpoint and trains on

    def __str__(self) -> str:
        return f"{self.engine}-rank{self.victim}-{self.point}-{self.fault}" + ("" if self.monitor else "-nomonitor") \
            + ("-caught" if self.catch else "") + ("-recovered" if self.recover else "")

    @property
    def bound(self) -> float:
        """How long after the fault every survivor must be gone."""
        return self.timeout + 5.0 if self.fault == "stop" else 10.0


def grid(seed: int, size: int | None = None) -> list:
    """A seeded draw of cases over engines, victims, points and faults (all of them when size is None)."""
    cases = [Case(e, v, p, f) for e in ENGINES for v in range(WORLD) for p in POINTS for f in FAULTS
             if (e, p) not in ABSENT]
    random.Random(seed).shuffle(cases)
    return cases if size is None else cases[:size]


def _env(case: Case, phase: str) -> dict:
    env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "CHAOS_TIMEOUT": str(case.timeout), "PHASE": phase,
           "PYTHONUNBUFFERED": "1"}
    if phase == "fault":
        env["CHAOS"] = f"{case.victim}:{case.point}:{case.fault}"
    if not case.monitor:
        env["DS_CHIMERA_FAULT_MONITOR"] = "0"
    if case.catch:
        env["CATCH"] = "1"
    if case.recover:
        env["RECOVER"] = "1"
    return env


def _start(case: Case, out: str, phase: str) -> list:
    port, procs = free_port(), []
    for rank in range(WORLD):
        env = dict(os.environ, **_env(case, phase), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                   LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        log = open(os.path.join(out, f"{phase}-rank{rank}.log"), "w")
        procs.append((subprocess.Popen([sys.executable, WORKER, case.engine, out], env=env, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    return procs


def _logs(out: str, phase: str) -> list:
    return [open(os.path.join(out, f"{phase}-rank{r}.log")).read() for r in range(WORLD)]


def run_case(case: Case, out: str, start_up_s: float = 240.0, resume: bool = True) -> dict:
    """Run the fault phase and (``resume``) the resume phase; returns what :func:`check_case` asserts on."""
    procs = _start(case, out, "fault")
    exits, deadline = {}, time.time() + start_up_s
    fault_at = None
    while time.time() < deadline:
        for rank, (proc, _) in enumerate(procs):
            if rank not in exits and proc.poll() is not None:
                exits[rank] = (time.time(), proc.returncode)
        if fault_at is None and os.path.exists(os.path.join(out, "fault.json")):
            fault_at = json.load(open(os.path.join(out, "fault.json")))["time"]
            deadline = fault_at + case.bound + 20.0         # room to see a late exit, beyond the bound
        # a caught failure ends every process normally, the victim's included (unless it was killed)
        waits_for_victim = case.catch and case.fault != "kill"
        if case.recover and case.fault == "kill" and fault_at is not None:
            deadline = fault_at + case.timeout + 20.0     # the survivors' scripts go on, then are ended
        if all(r in exits for r in range(WORLD) if r != case.victim or waits_for_victim):
            break
        time.sleep(0.05)
    for rank, (proc, log) in enumerate(procs):
        if proc.poll() is None:
            proc.kill()                   # the stopped victim, or a survivor that hung (a failure)
            proc.wait()
        log.close()
    result = {"fault_at": fault_at, "exits": {r: exits.get(r) for r in range(WORLD)}, "fault_logs": _logs(out, "fault")}
    caught = [os.path.join(out, f"caught-rank{r}.json") for r in range(WORLD)]
    result["caught"] = [json.load(open(path)) if os.path.exists(path) else None for path in caught]
    if not resume:
        return result
    procs = _start(case, out, "resume")
    for proc, log in procs:
        try:
            proc.wait(timeout=start_up_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    result["resume_codes"] = [proc.returncode for proc, _ in procs]
    result["resume_logs"] = _logs(out, "resume")
    result["resume"] = [json.load(open(path)) if os.path.exists(path) else None
                        for path in (os.path.join(out, f"resume-rank{r}.json") for r in range(WORLD))]
    return result


def check_case(case: Case, result: dict) -> float:
    """Assert containment, blame and recovery; returns the slowest survivor's exit, in seconds after the fault."""
    assert result["fault_at"] is not None, f"{case}: the fault never fired\n{result['fault_logs'][case.victim][-3000:]}"
    worst = 0.0
    for rank in range(WORLD):
        if rank == case.victim:
            continue
        log = result["fault_logs"][rank]
        exited = result["exits"][rank]
        assert exited is not None, f"{case}: rank {rank} was still running\n{log[-3000:]}"
        when, code = exited
        worst = max(worst, when - result["fault_at"])
        assert code != 0 and "finished all steps" not in log, f"{case}: rank {rank} did not fail\n{log[-3000:]}"
        if case.monitor:
            assert f"ds_chimera: rank {case.victim} failed" in log, f"{case}: rank {rank} blamed someone else\n" \
                                                                    f"{log[-3000:]}"
        else:        # no monitor to name the origin: a bounded wait names what did not answer
            assert "did not answer" in log or "did not arrive after" in log, f"{case}: rank {rank} ended " \
                                                                              f"without a timeout\n{log[-3000:]}"
    assert worst <= case.bound, f"{case}: a survivor took {worst:.1f}s (bound {case.bound:g}s)"
    if "resume_codes" not in result:
        return worst
    assert result["resume_codes"] == [0] * WORLD, f"{case}: the resumed run failed\n" + \
        "\n".join(log[-2000:] for log in result["resume_logs"])
    for rank, resumed in enumerate(result["resume"]):
        assert resumed is not None and resumed["first"] == 2, (case, rank, resumed)
        assert not [name for name in resumed["left"] if name.endswith((".incomplete", ".old"))], resumed["left"]
        if case.engine == "wavelet":
            assert resumed["final_param_diff"] <= 1e-6, (case, rank, resumed["final_param_diff"])
        else:
            got = {int(k): v for k, v in resumed["losses"].items()}
            assert sorted(got) == list(range(2, 6))
            assert all(abs(got[s] - resumed["reference"][s]) <= 1e-5 for s in got), (case, rank, got,
                                                                                       resumed["reference"])
    return worst


def check_caught(case: Case, result: dict) -> float:
    """Every rank's train_batch raised (the victim its own error, the others JobFailed naming it) within the
    bound, a second call raised at once, and every surviving process ended normally (exit code 0)."""
    assert result["fault_at"] is not None, f"{case}: the fault never fired\n{result['fault_logs'][case.victim][-3000:]}"
    worst = 0.0
    for rank in range(WORLD):
        log = result["fault_logs"][rank]
        if rank == case.victim and case.fault == "kill":
            continue
        got = result["caught"][rank]
        assert got is not None, f"{case}: rank {rank} caught nothing\n{log[-3000:]}"
        first, again = got["caught"], got["again"]
        if rank == case.victim:
            assert first["type"] == "RuntimeError" and "chaos: injected failure" in first["message"], (case, first)
        else:
            assert first["type"] == "JobFailed" and f"ds_chimera: rank {case.victim} failed" in first["message"], \
                (case, rank, first)
        worst = max(worst, first["time"] - result["fault_at"])
        assert again["type"] == "JobFailed" and again["seconds"] < 1.0, (case, rank, again)
        exited = result["exits"][rank]
        if case.recover and case.fault == "kill":
            check_ended(case, rank, result, log)
            continue
        assert exited is not None and exited[1] == 0, f"{case}: rank {rank} did not end normally ({exited})\n" \
                                                      f"{log[-3000:]}"
    assert worst <= case.bound, f"{case}: a rank raised {worst:.1f}s after the fault (bound {case.bound:g}s)"
    if case.recover and case.fault != "kill":
        for rank in range(WORLD):
            check_recovered(case, rank, result["caught"][rank]["recovered"], result["fault_logs"][rank])
    return worst


def check_ended(case: Case, rank: int, result: dict, log: str) -> None:
    """A killed rank: a survivor's script that goes on (a new PipelineModule waits for the dead rank in
    its group creation) is ended within the pipeline timeout, saying why."""
    exited = result["exits"][rank]
    assert exited is not None and exited[1] != 0 and exited[0] - result["fault_at"] <= case.timeout + 10.0, \
        f"{case}: rank {rank} was not ended in time ({exited})\n{log[-3000:]}"
    assert f"ds_chimera: rank {case.victim} failed" in log and "nothing can go on" in log, (case, rank, log[-3000:])


def check_recovered(case: Case, rank: int, got: dict, log: str) -> None:
    """After a caught raise: a new engine resumed from the latest checkpoint reproduces the uninterrupted
    run, and the failed engine refuses to run."""
    assert "error" not in got, f"{case}: rank {rank} could not go on: {got.get('error')}\n{log[-3000:]}"
    losses = {int(k): v for k, v in got["losses"].items()}
    assert got["first"] == 2 and sorted(losses) == list(range(2, 6)), (case, rank, got)
    assert all(abs(losses[s] - got["reference"][s]) <= 1e-5 for s in losses), (case, rank, losses, got["reference"])
    old = got["old_engine"]
    assert old["type"] == "JobFailed" and "build a new engine" in old["message"] and \
        f"rank {case.victim} failed" in old["message"] and old["seconds"] < 1.0, (case, rank, old)
    assert "recovered and finished" in log, (case, rank, log[-3000:])
