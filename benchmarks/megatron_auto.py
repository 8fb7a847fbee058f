"""Megatron's ``"auto"``: the planner's pick against every schedule of the built placement, side by side.

    python benchmarks/megatron_auto.py            # N in {8, 16}, 15 rounds
    python benchmarks/megatron_auto.py --quick    # N = 8, 7 rounds

Four CPU ranks (gloo), Megatron's contract without Megatron's parallel state (the pipeline group
is the world). One model chunk per rank, as Megatron's own ``get_model`` builds it, of timed
layers (``harness.TimedLayer`` sleeps for its cost, so 4 ranks on 2 cores measure schedules, not
the cores) with unequal stages: ``STAGE_UNITS`` cost units of F = I = W each. Rows, built first
and then stepping in turn (one call each per round, medians):

- ``get_forward_backward_func("auto")`` with its default budget (Megatron's 1F1B peak) and with a
  loose one (``max_activations = N``): the first call profiles, the warm-up round plans;
- every schedule that runs this placement, named directly: 1f1b, zb-h1, gpipe;
- the placement the default-budget auto row advises (``AutoRunner.advice``: Chimera's, where it predicts
  it at least 3% faster), built as its own chunks and named, to measure the advice.

Printed per budget: the pick, its measured step over the best measured row that fits the budget,
its predicted step (the planner's, on the first call's profile) over its measured one. The last
line is a JSON object with every row.
"""
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import (MICRO, WIDTH, EntryLayer, TimedLayer, benchmark_parser, launch,  # noqa: E402
                     median_steps_in_turn, report, save_rows, share_one_device)

UNIT_S = 0.005
STAGE_UNITS = [2, 2, 3, 4]         # per stage: a light first stage, a heavier last one (an LM head's place)
NAMED = ["1f1b", "zb-h1", "gpipe"]  # every synchronous schedule with Megatron's one chunk per rank


def build_chunk(stage: int):
    import torch
    from torch import nn

    class TimedChunk(nn.Module):
        """One stage: Megatron's set_input_tensor contract over timed layers."""

        def __init__(self):
            super().__init__()
            self.entry = EntryLayer() if stage == 0 else None
            self.layers = nn.ModuleList(TimedLayer(UNIT_S, UNIT_S, UNIT_S) for _ in range(STAGE_UNITS[stage]))
            self.input = None

        def set_input_tensor(self, inputs):
            self.input = inputs[0] if isinstance(inputs, (list, tuple)) else inputs

        def forward(self, x):
            h = self.entry(x) if self.input is None else self.input
            for layer in self.layers:
                h = layer(h)
            return h
    torch.manual_seed(stage)
    return TimedChunk()


def forward_step(data_iterator, model):
    x, y = next(data_iterator)
    out = model(x)

    def loss_func(output):
        loss = ((output - y) ** 2).mean()
        return loss, {"loss": loss.detach()}
    return out, loss_func


def worker(args):
    import torch
    import torch.distributed as dist

    import ds_chimera.megatron as dsm

    share_one_device()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    chunk = build_chunk(rank)
    rows = []
    for n in args.micro_batches:
        batch = [(torch.randn(MICRO, WIDTH), torch.randn(MICRO, WIDTH)) for _ in range(n)]
        functions = [("auto (Megatron's 1F1B peak)", dsm.get_forward_backward_func("auto", timeout=120)),
                     (f"auto (max_activations={n})", dsm.get_forward_backward_func("auto", timeout=120,
                                                                                   max_activations=n))]
        functions += [(name, dsm.get_forward_backward_func(name, timeout=120)) for name in NAMED]

        def stepper(fb, chunks=(chunk,)):
            def step():
                for c in chunks:
                    c.zero_grad(set_to_none=True)
                fb(forward_step_func=forward_step, data_iterator=iter(batch), model=list(chunks), num_microbatches=n,
                   seq_length=1, micro_batch_size=MICRO)
            return step
        steps = [stepper(fb) for _, fb in functions]
        for step, (name, _) in zip(steps, functions):     # the auto rows profile and plan on their first call
            if name.startswith("auto"):
                step()
        advised = _advised_row(dsm, functions, n, rank, dist.get_world_size())
        if advised is not None:
            functions.append(advised[:2])
            steps.append(stepper(advised[1], advised[2]))
        if rank == 0:
            print(f"  N={n}: {len(functions)} rows; timing {args.repeats} rounds, taking turns", flush=True)
        medians = median_steps_in_turn(dist, steps, args.repeats)
        by_name = {}
        for (name, fb), median in zip(functions, medians):
            row = {"N": n, "row": name, "step_s": median}
            if name.startswith("auto"):
                runner = fb.runner
                chosen = runner.decisions[(dist.get_world_size(), n)]
                row.update(pick=chosen.schedule, profiled_with=runner.layout.schedule,
                           stage_fwd_s=[layer.fwd for layer in runner.profile.layers],
                           predicted_s=runner.predicted[(dist.get_world_size(), n)])
            rows.append(row)
            by_name[name] = row
        for name in [f for f, _ in functions if f.startswith("auto")]:
            pick = by_name[name]
            limit = n if "max_activations" in name else min(dist.get_world_size(), n)
            fitting = [by_name[s] for s in NAMED if _peak(s, dist.get_world_size(), n) <= limit]
            best = min(fitting, key=lambda r: r["step_s"])
            summary = {"N": n, "budget": name, "pick": pick["pick"], "pick_step_s": pick["step_s"],
                       "best": best["row"], "best_step_s": best["step_s"],
                       "pick_over_best": pick["step_s"] / best["step_s"],
                       "predicted_over_measured": pick["predicted_s"] / pick["step_s"],
                       "pick_named_step_s": by_name[pick["pick"]]["step_s"]}
            rows.append({"summary": summary})
            if rank == 0:
                print(f"  N={n} {name}: pick {pick['pick']} measured {pick['step_s'] * 1e3:.1f} ms (named "
                      f"{summary['pick_named_step_s'] * 1e3:.1f} ms), best fitting {best['row']} "
                      f"{best['step_s'] * 1e3:.1f} ms: pick/best {summary['pick_over_best']:.3f}; predicted/measured "
                      f"{summary['predicted_over_measured']:.3f}", flush=True)
        if advised is not None:
            pick = by_name[functions[0][0]]
            row = by_name[advised[0]]
            summary = {"N": n, "advised": advised[0], "advised_predicted_s": advised[3],
                       "advised_step_s": row["step_s"], "pick": pick["pick"], "pick_step_s": pick["step_s"],
                       "advised_over_pick": row["step_s"] / pick["step_s"],
                       "advised_predicted_over_measured": advised[3] / row["step_s"]}
            rows.append({"summary": summary})
            if rank == 0:
                print(f"  N={n} advised placement {advised[0]}: measured {row['step_s'] * 1e3:.1f} ms, "
                      f"{summary['advised_over_pick']:.3f}x the pick's (predicted "
                      f"{advised[4]:.3f}x); predicted/measured {summary['advised_predicted_over_measured']:.3f}",
                      flush=True)
        if rank == 0:
            print("  " + "  ".join(f"{r['row']} {r['step_s'] * 1e3:.1f} ms" for r in rows
                                   if r.get("N") == n and "row" in r), flush=True)
    save_rows(dist, rows, args.out)


def _advised_row(dsm, functions, n: int, rank: int, world: int):
    """The placement the default-budget auto row advises (if any), built as its own chunks and named:
    (label, forward-backward function, chunks, predicted step, predicted ratio to the pick), or None."""
    advice = functions[0][1].runner.advice.get((world, n))
    if advice is None:
        return None
    fb = dsm.get_forward_backward_func(advice["schedule"], timeout=120, **advice["options"])
    placement = fb.config.build_schedule(world, n).placement
    chunks = [build_chunk(placement.chunks[c].stage) for c in placement.chunks_on(rank)]
    for c, chunk in zip(placement.chunks_on(rank), chunks):      # as build_model_chunks tags what it builds
        chunk._ds_chimera_stage, chunk._ds_chimera_built_for = placement.chunks[c].stage, (advice["schedule"],
                                                                                          dict(advice["options"]))
    label = advice["schedule"] + " " + ",".join(f"{k}={v}" for k, v in advice["options"].items()) + " (advised)"
    return label, fb, chunks, advice["step_s"], advice["ratio"]


def _peak(name: str, stages: int, n: int) -> int:
    from ds_chimera.schedules import registry
    from ds_chimera.schedules.actions import activation_peaks
    return max(activation_peaks(registry.get(name)(stages, n).orders))


def main():
    parser = benchmark_parser(__doc__)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.micro_batches is None:
        args.micro_batches = [8] if args.quick else [8, 16]
    if args.repeats is None:
        args.repeats = 7 if args.quick else 15
    if args.worker:
        return worker(args)
    out = os.path.join(tempfile.mkdtemp(prefix="dsc_megatron_auto_"), "rows.json")
    rows = launch(os.path.abspath(__file__), ["--micro-batches", *args.micro_batches, "--repeats", args.repeats],
                  out, keep=("  ",))
    return report(rows)


if __name__ == "__main__":
    sys.exit(main())
