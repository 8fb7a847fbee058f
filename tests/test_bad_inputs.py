"""The bad-input grid: each case launched on 4 plain processes (no launcher to end the others, as on other nodes)
with one file or key made bad. Each asserts: every rank raised (exit code not 0, no "no error"), every rank's
output names the key or the file, every rank had ended 10 s after the first did, and no given file changed.

CI runs one case (a plan_file for another layout); ``make test-full`` runs them all,
as ``benchmarks/RESULTS.md`` records.
"""
import hashlib
import json
import os
import subprocess
import sys
import time

import pytest

import tiers
from netutil import free_port, remove_deepspeed_shm

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "distributed", "bad_input_worker.py")
WORLD = 4
ENDED_WITHIN_S = 10.0


def _plan(parts):
    return json.dumps({"pipeline": {"schedule": "1f1b", "parts": parts}})


# case: (the "pipeline" section, files to write {name: text or bytes}, checkpoint file to damage, how, must name)
CASES = {
    "plan_file-garbage": ({"schedule": "auto", "plan_file": "{out}/plan.json"}, {"plan.json": b"\x00\xff{no"},
                          None, None, ['"pipeline": plan_file', "plan.json", "delete it to plan again"]),
    "plan_file-shape": ({"schedule": "auto", "plan_file": "{out}/plan.json"}, {"plan.json": "[1, 2]"},
                        None, None, ['"pipeline": plan_file', "plan.json", 'expected {"pipeline": {"schedule": NAME']),
    "plan_file-other-layout": ({"schedule": "auto", "plan_file": "{out}/plan.json"},
                               {"plan.json": _plan([0, 8, 16])}, None, None,
                               ["plan_file", "plan.json", "was written for 2 stages", "delete it to plan again"]),
    "profile_file-garbage": ({"schedule": "auto", "profile_file": "{out}/profile.json", "memory_limit_gb": 64},
                             {"profile.json": "{not json"}, None, None,
                             ['"pipeline": profile_file', "profile.json", "delete it to profile again"]),
    "program-missing": ({"program": "{out}/missing.program"}, {}, None, None,
                        ['"pipeline": program', "missing.program", "does not exist"]),
    "stages-mismatch": ({"schedule": "1f1b", "stages": 2}, {}, None, None, ['"stages": 2', "num_stages"]),
    "schedule-typo": ({"schedule": "chimera "}, {}, None, None, ["unknown schedule 'chimera '", "Did you mean 'chimera'"]),
    "timeout-negative": ({"schedule": "1f1b", "timeout": -1}, {}, None, None, ["timeout", "-1"]),
    "ckpt-layer-truncated": ({"schedule": "1f1b"}, {}, "layer_05-model_states.pt", "truncated",
                             ["layer_05-model_states.pt", "t1"]),
    "ckpt-states-garbage": ({"schedule": "1f1b"}, {}, "mp_rank_00_model_states.pt", "garbage",
                            ["mp_rank_00_model_states.pt", "t1"]),
    "ckpt-layout-truncated": ({"schedule": "1f1b"}, {}, "ds_chimera_layout.json", "truncated",
                              ["ds_chimera_layout.json", "t1", "load another tag"]),
}
CI = ["plan_file-other-layout"]      # the damaged-checkpoint cases need a saving launch first: make test-full
SELECTED = list(CASES) if tiers.FULL else CI


def _env(extra: dict) -> dict:
    return dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)


def _launch(args: list, out: str, phase: str, extra: dict, limit_s: float = 240.0) -> list:
    """4 plain processes; returns [(exit code, end time, output)] per rank (None for one still running at the limit)."""
    port, procs = free_port(), []
    for rank in range(WORLD):
        env = _env(dict(extra, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                        LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
        log = open(os.path.join(out, f"{phase}-rank{rank}.log"), "w")
        procs.append((subprocess.Popen([sys.executable, WORKER, *args], env=env, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    ends, deadline = {}, time.time() + limit_s
    while len(ends) < WORLD and time.time() < deadline:
        for rank, (proc, _) in enumerate(procs):
            if rank not in ends and proc.poll() is not None:
                ends[rank] = (proc.returncode, time.time())
        if ends and time.time() > min(t for _, t in ends.values()) + ENDED_WITHIN_S + 20:
            break                               # room to see a late exit; the assertion below judges it
        time.sleep(0.05)
    results = []
    for rank, (proc, log) in enumerate(procs):
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        with open(os.path.join(out, f"{phase}-rank{rank}.log")) as fh:
            text = fh.read()
        code, when = ends.get(rank, (None, None))
        results.append((code, when, text))
    remove_deepspeed_shm()
    return results


def _digests(root: str) -> dict:
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            if name.endswith(".log") or name == "section.json":
                continue
            path = os.path.join(folder, name)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One checkpoint, written once, copied into each checkpoint case."""
    out = tmp_path_factory.mktemp("bad_inputs_saved")
    if not any(CASES[case][2] for case in SELECTED):
        return None
    results = _launch(["save", str(out)], str(out), "save", {})
    assert all(code == 0 for code, _, _ in results), "\n".join(text[-2000:] for _, _, text in results)
    return out / "ckpt"


@pytest.mark.parametrize("case", SELECTED)
def test_a_bad_input_is_named_on_every_rank_and_ends_every_rank(case, tmp_path, saved):
    import shutil
    section, files, damaged, how, names = CASES[case]
    out = str(tmp_path)
    for name, content in files.items():
        mode = "wb" if isinstance(content, bytes) else "w"
        with open(os.path.join(out, name), mode) as fh:
            fh.write(content)
    extra = {}
    if damaged:
        shutil.copytree(saved, os.path.join(out, "ckpt"))
        path = os.path.join(out, "ckpt", "t1", damaged)
        data = open(path, "rb").read()
        with open(path, "wb") as fh:
            fh.write(data[: len(data) // 2] if how == "truncated" else b"\x00\xffnot this file\n")
        extra["LOAD"] = "1"
    section = json.loads(json.dumps(section).replace("{out}", out))
    with open(os.path.join(out, "section.json"), "w") as fh:
        json.dump(section, fh)
    before = _digests(out)
    results = _launch(["run", out, os.path.join(out, "section.json")], out, "run", extra)
    first = min(when for _, when, _ in results if when is not None)
    for rank, (code, when, text) in enumerate(results):
        assert code is not None and when - first <= ENDED_WITHIN_S, f"{case}: rank {rank} still ran {ENDED_WITHIN_S}s " \
                                                                     f"after the first rank ended\n{text[-3000:]}"
        assert code != 0 and "no error" not in text, f"{case}: rank {rank} did not fail\n{text[-3000:]}"
        missing = [name for name in names if name not in text]
        assert not missing, f"{case}: rank {rank}'s output does not name {missing}\n{text[-3000:]}"
    assert _digests(out) == before, f"{case}: a given file changed"
