"""Megatron-Core integration: the forward-backward contract on 4 gloo ranks, install, launcher, example."""
import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest

from netutil import free_port, run_ranks
from tiers import FULL

pytest.importorskip("megatron.core", reason="megatron-core is installed by `make install`")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "distributed", "megatron_worker.py")
SYNCHRONOUS = ["gpipe", "1f1b", "interleaved", "breadth-first", "chimera", "zb-h1", "zbv", "dualpipev"]


def _env():
    return dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))


@pytest.fixture(scope="module")
def contract_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", str(free_port()),
           WORKER, str(out)]
    # output to files, not pipes, and the launch in its own session, killed whole at the end: a child a rank
    # leaves behind (Megatron's checkpoint writer processes) must neither hold the pipes open nor outlive the test
    with open(out / "stdout.txt", "w+") as stdout, open(out / "stderr.txt", "w+") as stderr:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, text=True, env=_env(), start_new_session=True)
        try:
            proc.wait(timeout=900)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        stdout.seek(0)
        stderr.seek(0)
        assert proc.returncode == 0, stdout.read()[-3000:] + stderr.read()[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def test_every_synchronous_schedule_matches_single_process_training(contract_results):
    """Gradients of every chunk equal one whole GPTModel's, trained in one process on the global batch."""
    cases = [c for c in contract_results[0] if "schedule" in c]
    # CI: five schedules and their variants; make test-full: every synchronous one
    expected = SYNCHRONOUS if FULL else ["1f1b", "interleaved", "chimera", "zb-h1", "zbv"]
    assert sorted({c["schedule"] for c in cases if c["pp"] == 4}) == sorted(expected)
    assert {"order": "zero-bubble", "pipelines": 2} in [c["options"] for c in cases if c["schedule"] == "chimera"]
    assert ({"order": "zero-bubble"} in [c["options"] for c in cases if c["schedule"] == "chimera"]) == FULL
    # and with Megatron DDP's main_grad accumulation: a split backward and Chimera's replica sum
    assert {c["schedule"] for c in cases if c["grads"] == "main_grad"} == {"zb-h1", "chimera"}
    # 2 x 2 pipe x data (make test-full adds interleaved)
    assert {c["schedule"] for c in cases if c["pp"] == 2} == ({"chimera", "interleaved"} if FULL else {"chimera"})
    for rank, results in enumerate(contract_results):
        for case in (c for c in results if "schedule" in c):
            what = f"rank {rank} {case['schedule']} pp={case['pp']}"
            assert case["weight_diff"] == 0.0, what           # the chunks are the reference's stages
            assert case["grad_norm"] > 0.1, what               # there is a gradient to compare
            assert case["grad_diff"] <= 1e-6, what
            assert case["finalize_calls"] == 1, what           # config.finalize_model_grads_func, once per call
            assert case["hooks_added"] == 0, what               # the chunks' modules left as they were


def test_placements_and_loss_dicts_follow_the_schedule(contract_results):
    by_rank = [{(c["schedule"], c["pp"]): c for c in results
                if "schedule" in c and c["grads"] == "grad" and not c["options"].get("order")}
               for results in contract_results]
    assert [by_rank[r][("chimera", 4)]["stages"] for r in range(4)] == [[0, 3], [1, 2], [2, 1], [3, 0]]
    assert [by_rank[r][("zbv", 4)]["stages"] for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [by_rank[r][("interleaved", 4)]["stages"] for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert sum(by_rank[r][("chimera", 4)]["holds_loss"] for r in range(4)) == 2     # both ends of Chimera
    assert by_rank[0][("zbv", 4)]["holds_loss"] and not by_rank[3][("zbv", 4)]["holds_loss"]   # V: rank 0
    for results in contract_results:
        for case in (c for c in results if "schedule" in c):
            # Megatron's schedules return the dicts on the last pipeline rank, [] elsewhere: so does the
            # contract, wherever the schedule computes the loss (Chimera: two ranks; zbv: rank 0)
            what = (case["schedule"], case["options"], case["pp"], case["pipe_rank"])
            expected = 8 if case["pipe_rank"] == case["pp"] - 1 else 0
            assert case["losses"] == expected and case["eval_losses"] == expected, what
            assert case["own_dicts"] == 8, what
            if expected:     # equal to Megatron-Core's own dicts for the same loss_func, value for value
                assert case["dict_diff"] <= 1e-6 and case["eval_dict_diff"] <= 1e-6, what
                # (loss, reduced) with reduced holding loss.detach(): Megatron's in-place division shows
                assert case["divided_in_place"] == (case["loss_form"] == 2), what


def test_distributed_checkpoints_of_chunk_lists_load_into_any_layout(contract_results):
    """Chimera's chunks (replicas deduplicated) saved with dist_checkpointing load exactly into zbv,
    interleaved and Megatron's own plain pipeline (Megatron's API alone), and back."""
    for results in contract_results:
        found = results[-3]["dist_checkpoints"]
        assert found["tensors"] > 50
        for pair in ("chimera->zbv", "chimera->interleaved", "chimera->chimera", "chimera->plain", "plain->chimera"):
            same_keys, diff = found[pair]
            assert same_keys and diff == 0.0, (pair, found[pair])


def test_unsplittable_setups_are_refused_on_every_rank(contract_results):
    for results in contract_results:
        refusals = results[-2]["refusals"]
        assert "gradient_accumulation_fusion=True adds weight gradients during the input pass" in refusals["fusion"]
        assert "recompute_granularity='full'" in refusals["recompute"]
        assert "collect_non_loss_data=True needs forward_only=True" in refusals["non-loss-training"]
        # chunks in another layout, found before the first forward, with what to pass instead
        assert "(built for 'interleaved' with {'chunks': 2}), but schedule 'zbv' with no options puts stage" \
            in refusals["tagged-layout"] and "build_model_chunks(model_provider, 'zbv')" in refusals["tagged-layout"]
        assert "holds decoder layers" in refusals["megatron-layout"] and \
            "as Megatron's own virtual-pipeline layout puts stage v*D + r on rank r), but schedule 'zbv' puts stage" \
            in refusals["megatron-layout"]
        # chunks not built for a schedule with its own placement: refused on every rank, naming the rank that has them
        bare = refusals["bare-chimera"]
        assert bare and "schedule 'chimera' places its own stages" in bare and "was not built for it" in bare
        assert "build_model_chunks(model_provider, 'chimera')" in bare
        assert "install(\"interleaved\")" in refusals["virtual-1f1b"]
    assert [results[-2]["refusals"]["bare-chimera"].startswith("pipeline rank 2's model chunks")
            for results in contract_results] == [True, True, False, True]


def test_after_a_caught_failure_the_process_goes_on_once_megatrons_groups_are_rebuilt(contract_results):
    for rank, results in enumerate(contract_results):
        found = next(r["caught_failure"] for r in results if "caught_failure" in r)
        if rank == 1:
            assert found["first"] == "RuntimeError: injected failure in rank 1's forward_step", found
        else:
            assert found["first"].startswith("JobFailed: ds_chimera: rank 1 failed: RuntimeError: injected"), found
        assert found["again"].startswith("JobFailed: ds_chimera: rank 1 failed") and \
            "rebuild Megatron's model-parallel groups to go on" in found["again"], found
        assert found["after"] == found["before"] and len(found["before"]) == (8 if rank == 3 else 0), found


def test_install_routes_megatrons_get_forward_backward_func(contract_results):
    for rank, results in enumerate(contract_results):
        assert results[-1]["installed"] == "chimera" and results[-1]["restored_is_megatron"]
        # build_model_chunks() follows the installed schedule, with V = Megatron's virtual-pipeline size
        assert results[-1]["built_for"] == [["breadth-first", {"chunks": 2}]] * 2
        assert results[-1]["built_stages"] == [rank, rank + 4]


def test_auto_times_the_first_call_then_runs_the_fastest_schedule_for_the_built_chunks(contract_results):
    """"auto": the first training call runs the chunks' own layout timed (ZB-H1 on Megatron's one chunk per rank,
    whose config can split the backward; the built-for schedule on build_model_chunks' chunks); then every rank
    runs the same plan, among the schedules of that placement, within the activation budget."""
    for rank, results in enumerate(contract_results):
        auto = next(r["auto"] for r in results if "auto" in r)
        layout, chimera = auto["layout"], auto["chimera"]
        assert layout["profiled_with"] == ["zb-h1", {}]
        assert chimera["profiled_with"] == ["chimera", {"order": "merged"}]
        assert all(t > 0 for t in layout["stage_fwd"] + layout["stage_wgrad"])      # every stage timed
        assert chimera["stage_wgrad"] == [-1.0] * 4                             # merged does not split it
        # the layout's plan: never more activations than Megatron's 1F1B (4), so not GPipe (8)
        assert layout["chosen"]["8"][0] in ("1f1b", "zb-h1"), layout["chosen"]
        # Chimera's chunks under a 4-activation budget: merged (5) and forward-doubling (8) do not fit, the
        # zero-bubble order's weight gradient was not timed apart: concat, a switch from the profiled order
        assert chimera["chosen"] == {"8": ["chimera", {"pipelines": 1, "order": "concat"}],
                                     "4": ["chimera", {"pipelines": 1, "order": "concat"}]}
        assert "holds 5 micro-batches of activations on a rank, over the limit of 4" in chimera["report"]
        assert "places stages [[0], [1], [2], [3]] on the ranks; the chunks were built as" in chimera["report"]
        for case in (layout, chimera):
            assert case["grad_norm"] > 0.1
            assert case["grad_diff"] <= 1e-6          # the profiled call and the planned call: the same gradients
        if rank == 0:
            assert [p["num_microbatches"] for p in chimera["plan_file"]["plans"]] == [8, 4]
            assert chimera["plan_file"]["plans"][0]["options"] == {"pipelines": 1, "order": "concat"}
        assert auto["rerun"] == {"profiled": False, "chosen": chimera["chosen"]["8"]}     # the plan_file, as written
        assert chimera["chosen"] == next(r["auto"] for r in contract_results[0] if "auto" in r)["chimera"]["chosen"]
        assert layout["chosen"] == next(r["auto"] for r in contract_results[0] if "auto" in r)["layout"]["chosen"]


def test_auto_advises_a_faster_placement_the_built_chunks_cannot_run():
    """Megatron builds the chunks before the first call, so "auto" runs the best schedule of that placement; where
    Chimera's placement (the same stages, priced exactly by the measured stage costs) is predicted clearly faster,
    the report says so, with the call that builds its chunks; where replica gradient syncs cost more, it does not."""
    from ds_chimera.megatron.auto import ADVICE_MARGIN, placement_advice, rank_stages
    from ds_chimera.planner.profile import LayerCost, Links, Profile
    from ds_chimera.planner.search import Budget, Setting, plan
    stages, n = 4, 8
    layers = tuple(LayerCost(f"stage {s}", 1.0, 2.0, 1.0, 0, 4096, 1000, 250) for s in range(stages))
    built = tuple((r,) for r in range(stages))          # Megatron's one chunk per rank
    setting, budget = Setting(stages=stages, micro_batches=n), Budget(max_activations=stages)

    def advice(sync_s):
        profile = Profile(layers, Links(allreduce_latency_s=sync_s, wide_allreduce_latency_s=sync_s))
        chosen = plan(profile, setting, budget, cuts=("uniform",),
                      accept=lambda placed: None if rank_stages(placed.placement) == built else "another").chosen
        return chosen, placement_advice(profile, setting, budget, chosen, built, w_measured=True)

    chosen, advised = advice(0.0)
    assert chosen.schedule == "zb-h1" and chosen.step_s == 27.0
    assert (advised["schedule"], advised["options"]) == ("chimera", {"pipelines": 1, "order": "zero-bubble"})
    assert advised["step_s"] == 25.0 and advised["ratio"] < ADVICE_MARGIN and advised["weight_copies"] == 2
    assert "build_model_chunks(provider, 'chimera', pipelines=1, order='zero-bubble')" in advised["text"]
    assert advice(3.0)[1] is None          # three units per replica sync: Chimera no longer wins


def test_auto_options_on_megatron_are_checked_before_any_work():
    from ds_chimera.config import PipelineConfig
    with pytest.raises(ValueError, match=r"\"auto\" on Megatron takes \['max_activations', 'plan_file'\].*"
                                         r"got \['memory_limit_gb'\]"):
        PipelineConfig.from_megatron("auto", {"memory_limit_gb": 4}, where="install")
    with pytest.raises(ValueError, match=r"install: max_activations must be a number of micro-batches >= 1 per rank, "
                                         r"got 0"):
        PipelineConfig.from_megatron("auto", {"max_activations": 0}, where="install")
    assert PipelineConfig.from_megatron("auto", {"max_activations": 4, "timeout": 9}).planned


def test_dead_rank_stops_the_others_with_a_clear_error():
    timeout_s = 5
    try:
        outputs, _ = run_ranks([WORKER, "dead", str(timeout_s)], 4, dict(_env(), DIE_RANK="3"), timeout_s=240)
    except TimeoutError:      # the hang limit; how fast the survivors stop is not asserted (a shared 2-core machine)
        pytest.fail("a surviving rank hung after its peer died")
    assert outputs[3][0] == 17
    for rank in (0, 1, 2):
        code, out, err = outputs[rank]
        assert code != 0 and "finished the step" not in out
        assert "ds_chimera: rank 3 failed: " in err, err[-3000:]      # the dead rank is named, not a neighbour


def test_a_failure_while_auto_measures_the_links_ends_every_rank_naming_it():
    """Megatron's "auto" measures the links on every rank after its first call: rank 2 failing there (its script
    going on) leaves the others in the measurement's collectives; the fault guard ends them within seconds."""
    exit_times = []
    try:
        outputs, _ = run_ranks([WORKER, "auto-fault", "2"], 4, _env(), timeout_s=240, exit_times=exit_times)
    except TimeoutError as exc:
        pytest.fail(f"a rank hung after rank 2 failed while the links were measured: {exc}")
    fault_at = float(next(line for line in outputs[2][1].splitlines() if line.startswith("auto-fault at")).split()[-1])
    assert "injected failure on rank 2" in outputs[2][1] and outputs[2][0] == 0, outputs[2][1][-2000:]
    for rank in (0, 1, 3):
        code, out, err = outputs[rank]
        assert "finished the step" not in out
        caught = [line for line in out.splitlines() if line.startswith("auto-fault caught at")]
        if caught:       # the measurement's collective broke: the call raised JobFailed naming rank 2
            assert "JobFailed: ds_chimera: rank 2 failed: " in caught[0], caught[0]
            ended = float(caught[0].split()[3].rstrip(":"))
        else:            # stranded: the monitor ended the process, naming rank 2
            assert code != 0 and "ds_chimera: rank 2 failed: " in err, err[-3000:]
            ended = exit_times[rank]
        assert ended - fault_at <= 10.0, f"rank {rank} ended {ended - fault_at:.1f}s after the failure\n{err[-2000:]}"
        assert ended < exit_times[2], f"rank {rank} was freed by rank 2's process ending, not told\n{err[-2000:]}"


def test_bad_schedule_names_and_options_fail_before_any_work():
    from ds_chimera.megatron import get_forward_backward_func
    with pytest.raises(ValueError, match="unknown schedule 'chimera2'. Did you mean 'chimera'\\? Available: .*chimera"):
        get_forward_backward_func("chimera2")
    with pytest.raises(ValueError, match="Did you mean 'chimera'") as typo:
        get_forward_backward_func("chimera ")
    assert "pipeoptim" not in str(typo.value)       # Megatron's contract runs synchronous schedules only
    with pytest.raises(ValueError, match="schedule 'chimera' has no option 'chunks'; allowed: "):
        get_forward_backward_func("chimera", chunks=2)
    with pytest.raises(ValueError, match="'pipeoptim' is asynchronous.*use a synchronous schedule: "):
        get_forward_backward_func("pipeoptim")
    with pytest.raises(ValueError, match="timeout must be a finite number of seconds > 0, got 0"):
        get_forward_backward_func("1f1b", timeout=0)
    fb = get_forward_backward_func("interleaved", chunks=2)
    assert fb.schedule == "interleaved" and fb.options == {"chunks": 2}


def test_the_schedule_flag_is_taken_out_of_argv():
    from ds_chimera.megatron.choice import chosen_schedule
    argv = ["pretrain_gpt.py", "--num-layers", "8", "--pipeline-schedule", "chimera",
            "--pipeline-schedule-options", '{"pipelines": 2}', "--lr", "1e-3"]
    assert chosen_schedule(argv) == ("chimera", {"pipelines": 2})
    assert argv == ["pretrain_gpt.py", "--num-layers", "8", "--lr", "1e-3"]     # Megatron's parser never sees them
    argv = ["x.py", "--pipeline-schedule=zbv"]
    assert chosen_schedule(argv)[0] == "zbv" and argv == ["x.py"]
    with pytest.raises(ValueError, match="must be a JSON object, got '\\[1\\]'"):
        chosen_schedule(["x.py", "--pipeline-schedule", "zbv", "--pipeline-schedule-options", "[1]"])


def test_install_takes_v_from_megatrons_virtual_pipeline_size(monkeypatch):
    import megatron.core.pipeline_parallel as pipeline_parallel
    from ds_chimera.megatron import install, uninstall
    megatrons = pipeline_parallel.get_forward_backward_func
    try:
        assert install("breadth-first") == "breadth-first"
        assert pipeline_parallel.get_forward_backward_func(vp_size=3).options == {"chunks": 3}
        assert pipeline_parallel.get_forward_backward_func().options == {}      # no virtual pipeline: the default
        monkeypatch.delenv("DS_CHIMERA_PIPELINE_SCHEDULE", raising=False)
        before = pipeline_parallel.get_forward_backward_func
        assert install(argv=["x.py"]) is None                                    # nothing chosen: nothing changes
        assert pipeline_parallel.get_forward_backward_func is before
    finally:
        uninstall()
    assert pipeline_parallel.get_forward_backward_func is megatrons


def test_micro_batch_feed_hands_each_forward_its_own_micro_batch():
    from ds_chimera.megatron.host import MicroBatchFeed, OneMicroBatch
    source = iter(range(100))
    feed = MicroBatchFeed(source, 4)
    assert next(OneMicroBatch(feed, 2)) == 2 and next(OneMicroBatch(feed, 0)) == 0
    feed.finish()                                   # a used iterator advances by exactly num_microbatches
    assert next(source) == 4
    once = OneMicroBatch(feed, 1)
    next(once)
    with pytest.raises(RuntimeError, match="next\\(data_iterator\\) twice for micro-batch 1"):
        next(once)
    short = MicroBatchFeed(iter(range(2)), 4)
    with pytest.raises(RuntimeError, match="ran out after 2 micro-batches; this call needs 4"):
        short.item(3)


def test_launcher_refuses_a_bad_schedule_before_starting_workers():
    out = subprocess.run([sys.executable, "-m", "ds_chimera.cli", "launch", "--torchrun", "--pipeline-schedule",
                          "spectrain", "--nproc_per_node", "4", "x.py"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "'spectrain' is asynchronous" in out.stderr


@pytest.mark.skipif(not FULL, reason="make test-full: a smoke run of the example; "
                    "the contract's equivalence above is CI's")
def test_example_launch_script_trains_under_the_launcher_flag():
    """examples/megatron_launch.sh (ds-chimera launch --pipeline-schedule zbv, megatron_gpt.py unchanged): loss falls."""
    env = dict(_env(), SCHEDULE="zbv", NPROC="4", PYTHON=sys.executable, MASTER_PORT=str(free_port()))
    cmd = ["bash", os.path.join(ROOT, "examples", "megatron_launch.sh"), "--steps", "12"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "schedule zbv on 4 pipeline ranks" in proc.stdout
    losses = [float(line.split(" loss ")[1].split()[0]) for line in proc.stdout.splitlines() if " loss " in line]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.3, losses


class _TiedLM(__import__("torch").nn.Module):
    """A head that reuses the embedding's weight outside the embedding's call, and a layer called twice."""

    def __init__(self, call_twice: bool):
        import torch
        super().__init__()
        self.call_twice = call_twice
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(11, 6)
        self.mid = torch.nn.Linear(6, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.twice = torch.nn.Linear(6, 6)

    def forward(self, ids):
        h = self.twice(self.mid(self.emb(ids)).tanh())
        if self.call_twice:
            h = self.twice(h)
        return (self.norm(h) @ self.emb.weight.t()).logsumexp(-1).mean()


@pytest.mark.parametrize("call_twice", [False, True], ids=["tied", "tied-and-called-twice"])
def test_split_backward_of_captured_blocks_equals_a_full_backward(call_twice):
    """I then W over forward-hook blocks gives exactly the gradients of one backward, tied weights included."""
    import torch
    from ds_chimera.megatron.weight_blocks import BlockRecorder, settle_blocks
    from ds_chimera.runtime.executor import split_input_grad
    model = _TiedLM(call_twice)
    ids = torch.tensor([[1, 4, 7], [2, 9, 3]])

    model(ids).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    capture, recorder = [], BlockRecorder(model)
    with recorder.recording(capture) as nodes:
        out = model(ids)
    recorder.close()
    settle_blocks(model, capture, nodes, out)
    work = split_input_grad([out], None, [], capture)
    deferred = {id(p) for _, _, params in work for p in params}
    assert id(model.mid.weight) in deferred                     # a plain block's W is really deferred
    if not call_twice:      # (a module called twice sends the whole chunk to one W pass instead)
        assert id(model.emb.weight) not in deferred             # the tied weight is not (its other use would be lost)
        assert model.emb.weight.grad is not None                # it got its gradient in the input pass
    for outs, grads, params in work:
        torch.autograd.backward(outs, grad_tensors=grads, inputs=params)
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, expected[name], atol=1e-6), name


def test_one_block_recorder_serves_every_forward_of_a_call_and_leaves_no_hook():
    """The host hooks a chunk's modules once per call (not per micro-batch): each forward's blocks still give
    exactly one backward's gradients, a forward outside a recording records nothing, and close() takes every
    hook off."""
    import torch
    from ds_chimera.megatron.weight_blocks import BlockRecorder, settle_blocks
    from ds_chimera.runtime.executor import split_input_grad
    model = _TiedLM(False)
    batches = [torch.tensor([[1, 4, 7], [2, 9, 3]]), torch.tensor([[5, 0, 10], [8, 6, 1]])]
    sum(model(ids) for ids in batches).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    recorder = BlockRecorder(model)
    assert sum(len(m._forward_hooks) for m in model.modules()) == 4       # emb, mid, norm, twice: once each
    work = []
    for ids in batches:
        capture = []
        with recorder.recording(capture) as nodes:
            out = model(ids)
        assert len(capture) == 4, capture
        settle_blocks(model, capture, nodes, out)
        work += split_input_grad([out], None, [], capture)
    assert recorder.capture is None
    model(batches[0])                                  # outside a recording: no block, no error
    for outs, grads, params in work:
        torch.autograd.backward(outs, grad_tensors=grads, inputs=params)
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, expected[name], atol=1e-6), name
    recorder.close()
    assert all(not m._forward_hooks for m in model.modules())


def test_a_micro_batch_count_the_schedule_cannot_run_raises_what_megatron_raises():
    """Megatron's own schedules raise RuntimeError for it (its schedule tests expect that); ValueError too."""
    from ds_chimera.config import PipelineConfig
    from ds_chimera.megatron.runner import ScheduleRunner
    runner = ScheduleRunner(PipelineConfig.from_megatron("interleaved", {"chunks": 2}))
    for error in (RuntimeError, ValueError):
        with pytest.raises(error, match=r"multiple of stages \(4\), got 6.*\(num_microbatches=6 on 4 pipeline ranks\)"):
            runner._schedule(4, 6)
    assert runner._schedule(4, 8)[0].micro_batches == 8


def test_virtual_stages_gives_each_schedules_virtual_pipeline_size_and_auto_megatrons_own():
    """Step 3 of docs/megatron.md for every schedule name the launcher takes, "auto" included (it plans among the
    schedules of the layout the model is built with: Megatron's default one stage per rank)."""
    import ds_chimera.megatron as dsm
    assert dsm.virtual_stages("auto", 4) is None
    assert dsm.virtual_stages("1f1b", 4) is None and dsm.virtual_stages("chimera", 4) is None
    assert dsm.virtual_stages("zbv", 4) == 2 and dsm.virtual_stages("interleaved", 4, chunks=3) == 3
    with pytest.raises(ValueError, match="Did you mean 'zbv'"):
        dsm.virtual_stages("zvb", 4)
