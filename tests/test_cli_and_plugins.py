"""The ds-chimera CLI and third-party schedules registered through entry points."""
import json
import subprocess
import sys
import textwrap

import pytest

from ds_chimera import cli
from ds_chimera.schedules import available, build
from ds_chimera.sim import simulate


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "ds_chimera.cli", *args], capture_output=True, text=True)


def test_simulate_json_last_line_has_the_documented_keys(capsys):
    assert cli.main(["simulate", "--schedule", "interleaved", "--stages", "4", "--micro-batches", "8",
                     "--chunks", "2", "--cost-bwd", "1", "--json"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    data = json.loads(last)
    for key in ("schedule", "stages", "micro_batches", "chunks", "makespan", "ideal", "bubble_ratio",
                "peak_activations", "weights_per_rank", "valid"):
        assert key in data
    assert data["chunks"] == 2 and data["valid"] is True
    assert data["ideal"] == 8 * 2.0
    assert data["bubble_ratio"] == round(3 / (2 * 8 + 3), 9)
    assert len(data["peak_activations"]) == 4


def test_simulate_takes_host_costs_per_message(capsys):
    def makespan(*extra):
        assert cli.main(["simulate", "--schedule", "gpipe", "--stages", "2", "--micro-batches", "1",
                         "--cost-comm", "0.5", *extra, "--json"]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["makespan"]
    # F, send, latency, receive, F, B, send, latency, receive, B
    assert makespan() == 7.0
    assert makespan("--cost-send", "0.1", "--cost-recv", "0.2") == 7.6


def test_simulate_takes_the_gradient_sync_post_cost(capsys):
    def makespan(*extra):
        assert cli.main(["simulate", "--schedule", "chimera", "--order", "concat", "--stages", "2",
                         "--micro-batches", "2", "--cost-fwd", "1", "--cost-bwd", "2", *extra, "--json"]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["makespan"]
    # each rank posts two syncs (stage 1's after its first backward, stage 0's after its last)
    assert makespan() == 6.0
    assert makespan("--cost-sync-post", "0.25") == 6.5


def test_simulate_takes_the_sharded_gather_costs(capsys):
    def makespan(*extra):
        assert cli.main(["simulate", "--schedule", "1f1b", "--stages", "2", "--micro-batches", "4", "--zero", "3",
                         "--data-parallel", "2", *extra, "--json"]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["makespan"]
    # 1f1b at ZeRO-3 gathers its one chunk once, before anything can hide it
    plain = makespan()
    assert makespan("--cost-gather", "0.5") == plain + 0.5
    assert makespan("--cost-gather-post", "0.125") == plain + 0.125
    assert makespan("--cost-gather-skew", "0.25") == plain + 0.25


def test_simulate_writes_trace_and_plot(tmp_path, capsys):
    trace, png = tmp_path / "t.json", tmp_path / "g.png"
    assert cli.main(["simulate", "--schedule", "chimera", "--stages", "4", "--micro-batches", "8",
                     "--order", "concat", "--trace", str(trace), "--plot", str(png)]) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == 2 * 8 * 4
    assert {e["args"]["replica"] for e in slices} == {0, 1}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_argument_exits_nonzero_with_the_message():
    proc = run_cli("simulate", "--schedule", "chimera", "--stages", "5", "--micro-batches", "8")
    assert proc.returncode != 0
    assert "chimera needs an even number of stages, got 5" in proc.stderr
    proc = run_cli("simulate", "--schedule", "1f1b", "--stages", "4", "--micro-batches", "8", "--chunks", "2")
    assert proc.returncode != 0 and "unknown option 'chunks'" in proc.stderr


def test_auto_ranks_schedules_that_fit_the_memory_limit(capsys):
    assert cli.main(["simulate", "--schedule", "auto", "--stages", "4", "--micro-batches", "8",
                     "--max-activations", "4", "--json"]) == 0
    out = capsys.readouterr().out
    ranking = json.loads(out.strip().splitlines()[-1])["ranking"]
    names = [r["schedule"] for r in ranking]
    assert "gpipe" not in names and "1f1b" in names
    assert all(max(r["peak_activations"]) <= 4 for r in ranking)
    spans = [r["makespan"] for r in ranking]
    assert spans == sorted(spans)
    assert "excluded: peak activations 8 > limit 4" in out
    # Chimera's orders and pipelines are ranked too: zero-bubble fits 1F1B's peak, forward-doubling not
    assert "chimera pipelines=1 order=zero-bubble" in names and "chimera pipelines=2 order=concat" in names
    assert "chimera pipelines=1 order=forward-doubling  excluded: peak activations 8 > limit 4" in out


PLUGIN = textwrap.dedent('''
    from ds_chimera.schedules import Schedule
    from ds_chimera.schedules.base import linear_placement
    from ds_chimera.schedules.classic import one_f_one_b_orders

    class Reversed1F1B(Schedule):
        """A third-party schedule: 1F1B with micro-batches in reverse order."""
        name = "reverse-1f1b"
        summary = "1F1B, last micro-batch first (a plugin)"

        def build_placement(self):
            return linear_placement(self.ranks, self.micro_batches)

        def build_orders(self):
            return one_f_one_b_orders(self.placement, 0, list(range(self.micro_batches))[::-1])
''')


def test_third_party_schedule_registers_through_entry_points(tmp_path, monkeypatch):
    (tmp_path / "myplugin.py").write_text(PLUGIN)
    dist = tmp_path / "myplugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: myplugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[ds_chimera.schedules]\nreverse-1f1b = myplugin:Reversed1F1B\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "reverse-1f1b" in available()
    result = simulate(build("reverse-1f1b", 4, 8).lower())
    assert result.valid
    proc = subprocess.run([sys.executable, "-m", "ds_chimera.cli", "schedules"], capture_output=True, text=True,
                          env={"PYTHONPATH": str(tmp_path), "PATH": ""})
    assert "reverse-1f1b" in proc.stdout and "[myplugin]" in proc.stdout


def test_an_asynchronous_plugin_must_state_the_asynchronous_contract():
    """synchronous = False promises what the asynchronous engine calls (update_interval, versions, ...):
    a class that says so without AsynchronousSchedule is refused by name, and one that subclasses it
    without those methods cannot be built."""
    from ds_chimera.schedules import registry
    from ds_chimera.schedules.asynchronous import PipeDream
    from ds_chimera.schedules.base import AsynchronousSchedule, Schedule

    class Loose(Schedule):
        name, synchronous = "loose-async", False
    with pytest.raises(ValueError, match="does not subclass ds_chimera.schedules.base.AsynchronousSchedule"):
        registry.register(Loose)

    class Partial(AsynchronousSchedule):
        name = "partial-async"

        def build_placement(self):
            return PipeDream(4, 8).placement

        def build_orders(self):
            return PipeDream(4, 8).orders
    with pytest.raises(TypeError, match="abstract"):
        Partial(4, 8)
    assert issubclass(PipeDream, AsynchronousSchedule) and PipeDream(4, 8).update_interval() == 1
