"""Runs the run_clm-shaped script (hf_clm.py) for many cases in one process group, for tests/test_hf_trainer.py.

    ds-chimera launch --torchrun --nproc_per_node 4 hf_worker.py pipeline ASSETS OUT CASE,CASE,...
    python hf_worker.py plain ASSETS OUT CASE,CASE,...

``pipeline``: each case runs ``hf_clm.main`` with a DeepSpeed config that has a ``"pipeline"``
section. Nothing here imports ds_chimera: ``ds-chimera launch`` does (the zero-code path).
``plain``: the same cases with the plain single-process ``transformers.Trainer`` (no DeepSpeed),
then the refusal cases, after ``import ds_chimera`` (the explicit-import path).

Each case writes OUT/CASE/: ``result-rankR.json`` per rank (log history, metrics, predictions)
and ``weights-rankR.pt`` (``trainer.model`` after training, on every rank); the trainer's own
output folder is OUT/CASE/out.
"""
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hf_clm  # noqa: E402

COMMON = ["--block_size", "32", "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "4",
          "--learning_rate", "3e-3", "--weight_decay", "0.1", "--warmup_steps", "2", "--lr_scheduler_type", "linear",
          "--logging_steps", "1", "--seed", "11", "--report_to", "none", "--disable_tqdm", "true",
          "--do_train", "--do_eval", "--max_eval_samples", "14", "--save_strategy", "no", "--ddp_timeout", "180"]

# name -> (model, schedule, pipeline stages, arguments, arguments that differ for the plain run)
CASES = {
    # GPT-2 (tied), grouped texts, 4 micro-batches per step, clipping active, evaluation during training, checkpoints
    "chimera-gpt2": ("gpt2", "chimera", 4, ["--gradient_accumulation_steps", "4", "--max_steps", "6",
                                            "--max_grad_norm", "0.5", "--eval_strategy", "steps", "--eval_steps", "3",
                                            "--save_strategy", "steps", "--save_steps", "3"], []),
    # Llama (untied), one padded line per example (padded batches), clipping set but never reached; HF's own
    # --gradient_checkpointing (the plain Trainer recomputes each decoder layer, the pipeline each layer)
    "1f1b-llama-padded": ("llama", "1f1b", 4, ["--gradient_accumulation_steps", "4", "--max_steps", "5",
                                               "--max_grad_norm", "1000", "--line_by_line",
                                               "--gradient_checkpointing"], []),
    # zbv: 8 stages of a 5-block GPT-2 on 4 ranks, clipping off
    "zbv-gpt2": ("gpt2-5", "zbv", 4, ["--gradient_accumulation_steps", "4", "--max_steps", "5",
                                      "--max_grad_norm", "0"], []),
    # 2 stages x 2 data-parallel: one step is 2 x 2 micro-batches, a single process's accumulation of 4
    "gpipe-2x2-llama-tied": ("llama-tied", "gpipe", 2, ["--gradient_accumulation_steps", "2", "--max_steps", "4"],
                             ["--gradient_accumulation_steps", "4"]),
}
RESUMED = {"chimera-gpt2-resumed": "chimera-gpt2"}     # resumes the other case's checkpoint-3
# pipelined only, compared with the plain fp32 run of the case named: --fp16, "fp16": {"enabled": "auto"}, a scale
# high enough that the first steps overflow (DeepSpeed's rule: skipped, the scale halved)
FP16 = {"zbv-gpt2-fp16": "zbv-gpt2"}
FP16_SECTION = {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 18, "loss_scale_window": 2, "hysteresis": 1,
                "min_loss_scale": 1}


def ds_config(schedule: str, stages: int) -> dict:
    return {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "steps_per_print": 1000,
            "pipeline": {"schedule": schedule, "stages": stages, "timeout": 120}}


def write_json(path: str, value) -> str:
    """Atomically (every rank writes the same file, and another may be reading it)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(value, fh)
    os.replace(tmp, path)
    return path


def argv_for(name: str, assets: str, out: str, pipelined: bool) -> list:
    base = RESUMED.get(name, FP16.get(name, name))
    model, schedule, stages, args, plain_args = CASES[base]
    argv = ["--config_name", os.path.join(assets, model), "--tokenizer_name", os.path.join(assets, "tokenizer"),
            "--train_file", os.path.join(assets, "train.txt"), "--validation_file", os.path.join(assets, "valid.txt"),
            "--output_dir", os.path.join(out, name, "out")] + COMMON + args
    if name in RESUMED:
        argv += ["--resume_from_checkpoint", os.path.join(out, base, "out", "checkpoint-3")]
    if pipelined:
        config = ds_config(schedule, stages)
        if name in FP16:
            config["fp16"] = dict(FP16_SECTION)
            argv += ["--fp16", "--save_strategy", "steps", "--save_steps", "3"]
        argv += ["--deepspeed", write_json(os.path.join(out, name, "ds_config.json"), config)]
    else:
        argv += plain_args
    return argv


def rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def run_case(name: str, assets: str, out: str, pipelined: bool) -> None:
    os.makedirs(os.path.join(out, name), exist_ok=True)
    trainer, results = hf_clm.main(argv_for(name, assets, out, pipelined))
    prediction = trainer.predict(trainer.eval_dataset)
    r = rank()
    record = {"class": type(trainer).__name__, "mro": [c.__name__ for c in type(trainer).__mro__],
              "log_history": trainer.state.log_history, "results": results,
              "predictions": prediction.predictions.tolist(), "label_ids": prediction.label_ids.tolist(),
              "predict_metrics": prediction.metrics, "world_process_zero": trainer.is_world_process_zero(),
              "should_log": trainer.args.should_log}
    engine = getattr(trainer, "engine", None)
    if engine is not None:     # pipelined: what the engine ran (precision, skipped steps) and HF's scheduler steps
        record["engine"] = {"skipped_steps": engine.skipped_steps, "global_steps": engine.global_steps,
                            "loss_scale": float(getattr(engine.optimizer, "cur_scale", 1.0)),
                            "stage_dtypes": sorted({str(p.dtype) for p in engine.module.parameters()}),
                            "lr_scheduler_steps": trainer.lr_scheduler.last_epoch,
                            "model_dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()})}
    write_json(os.path.join(out, name, f"result-rank{r}.json"), record)
    torch.save({k: v.detach().cpu() for k, v in trainer.model.state_dict().items()},
               os.path.join(out, name, f"weights-rank{r}.pt"))


REFUSALS = {
    # (case, extra arguments, config changes): the run must stop before any data work
    "refuse-zbv-layers": ("gpt2", ["--gradient_accumulation_steps", "4"], {"pipeline": {"schedule": "zbv"}}),
    "refuse-batch": ("gpt2", ["--gradient_accumulation_steps", "4"],
                     {"train_batch_size": 16, "pipeline": {"schedule": "chimera"}}),
    "refuse-schedule": ("gpt2", [], {"pipeline": {"schedule": "chimaera"}}),
}


def refusal(name: str, assets: str, out: str) -> dict:
    """Run a case that must be refused; report the message and whether any data was tokenized first."""
    model, args, config = REFUSALS[name]
    os.makedirs(os.path.join(out, name), exist_ok=True)
    path = write_json(os.path.join(out, name, "ds_config.json"), config)
    argv = ["--config_name", os.path.join(assets, model), "--tokenizer_name", os.path.join(assets, "tokenizer"),
            "--train_file", os.path.join(assets, "train.txt"), "--output_dir", os.path.join(out, name, "out"),
            "--deepspeed", path] + COMMON + args
    tokenized = []
    blocks, hf_clm.blocks = hf_clm.blocks, (lambda *a: tokenized.append(1) or blocks(*a))
    try:
        hf_clm.main(argv)
        return {"error": None, "tokenized": bool(tokenized)}
    except ValueError as exc:
        return {"error": str(exc), "tokenized": bool(tokenized)}
    finally:
        hf_clm.blocks = blocks


def run_example(out: str) -> None:
    """examples/hf_trainer.py, the explicit path (PipelineTrainer), as the docs run it: Llama on zbv."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "hf_trainer.py")
    spec = importlib.util.spec_from_file_location("hf_trainer_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main(["--model", "llama", "--schedule", "zbv", "--steps", "10", "--micro_batches", "4",
                  "--output_dir", os.path.join(out, "example")])


def main():
    mode, assets, out, names = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
    pipelined = mode == "pipeline"
    refusals = {}
    for name in names:
        if name in REFUSALS:
            # a world of 4 as the launcher would say, without starting it: refusals need no process group
            os.environ["WORLD_SIZE"] = "4"
            import ds_chimera  # noqa: F401  (the explicit path: imported before the Trainer is built)
            refusals[name] = refusal(name, assets, out)
        elif name == "example":
            run_example(out)
        else:
            run_case(name, assets, out, pipelined)
    if refusals:
        write_json(os.path.join(out, "refusals.json"), refusals)
    if pipelined:
        import torch.distributed as dist
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
