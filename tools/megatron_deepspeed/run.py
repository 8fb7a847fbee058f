"""Launch Megatron-DeepSpeed's unchanged ``pretrain_gpt.py`` on 4 CPU ranks (PP=4, TP=1, DP=1) with a DeepSpeed
JSON config, and write each iteration's lm loss to a file that diffs between runs.

Why: one command that runs the same small, seeded GPT training under stock DeepSpeed or, with ``--chimera``
(``MDS_CHIMERA=1``), under ds_chimera with the schedule named in the config, so the runs compare.

    python3 tools/megatron_deepspeed/run.py CONFIG.json OUTDIR [--chimera] [--iters 20] [--bf16 | --fp16]
                                            [--tensor-parallel T] [--data-parallel D] [--zero-stage Z]
                                            [--save DIR] [--load DIR] [--save-interval N] [-- MEGATRON ARGS...]

OUTDIR gets: ds_config.json (the config with the batch keys filled from the run's sizes), log.txt (every
rank's output), loss.tsv (``iteration  lm_loss  learning_rate  ms_per_iteration``, from the last rank's
Megatron log line), cmd.txt. Exit status: the launcher's (124 on --timeout).
Needs ``prepare.py`` run first (same --workdir).
"""
import argparse
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PROJECT = os.path.dirname(os.path.dirname(HERE))          # this checkout (ds_chimera, for --chimera)
RANKS = 4
ITER_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+) \|"
                     r" learning rate: ([\dE.+-]+) \|.*? lm loss: ([\dE.+-]+) \|")
SCALE_RE = re.compile(r" loss scale: ([\d.]+) \|")                       # fp16 only
SKIPPED_RE = re.compile(r" number of skipped iterations: +(\d+) \|")      # this log interval's


def model_args(a, workdir):
    data = os.path.join(workdir, "data", "corpus_text_document")
    tok = os.path.join(workdir, "tokenizer")
    args = [
        # model: 8 layers, hidden 64, 4 heads, seq 64
        "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64",
        # batch: micro 1, global 8 -> 8 micro-batches per step at DP=1
        "--micro-batch-size", str(a.micro_batch), "--global-batch-size", str(a.global_batch),
        "--train-iters", str(a.iters),
        # LR warmup then cosine decay, so the scheduler matters in every step
        "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine",
        "--lr-warmup-iters", str(max(1, a.iters // 4)), "--lr-decay-iters", str(a.iters),
        "--optimizer", "adam", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--weight-decay", "0.01",
        "--init-method-std", "0.02",
        "--clip-grad", "0",                     # Megatron's; DeepSpeed's "gradient_clipping" is 0 in configs/
        # exact repeatability and comparability between schedules: no dropout (its masks would depend on the
        # order micro-batches run on a rank), a fixed seed, per-layer seeded init on the CPU (see sitecustomize)
        "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234", "--use-cpu-initialization",
        # parallelism
        "--tensor-model-parallel-size", str(a.tensor_parallel),
        "--pipeline-model-parallel-size", str(RANKS // (a.tensor_parallel * a.data_parallel)),
        "--distributed-backend", "gloo",
        # CPU: the fused weight-gradient accumulation is apex's CUDA extension (fused_weight_gradient_mlp_cuda)
        "--no-gradient-accumulation-fusion",
        # CPU: with --bf16 the fused softmax would load Megatron's CUDA kernel (scaled_masked_softmax_cuda); fp32
        # never uses it, so the flag changes nothing there
        "--no-masked-softmax-fusion",
        # data (prepare.py)
        "--data-path", data, "--data-impl", "mmap", "--split", "100,0,0",
        "--vocab-file", os.path.join(tok, "vocab.json"), "--merge-file", os.path.join(tok, "merges.txt"),
        "--tokenizer-type", "GPT2BPETokenizer", "--num-workers", "0",
        # logging: every iteration, no evaluation
        "--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "0",
        # DeepSpeed
        "--deepspeed", "--deepspeed_config", os.path.join(a.outdir, "ds_config.json"), "--zero-stage",
        str(a.zero_stage),
    ]
    if a.bf16:
        args.append("--bf16")
    if a.fp16:
        # Megatron's loss-scale arguments are its own optimizer's; under --deepspeed the "fp16" section decides
        args.append("--fp16")
    if a.save:
        args += ["--save", a.save, "--save-interval", str(a.save_interval or a.iters)]
    if a.load:
        args += ["--load", a.load]
    return args + a.extra


def write_config(a):
    with open(a.config) as fh:
        cfg = json.load(fh)
    # the batch keys follow the run's sizes (Megatron and DeepSpeed must agree on them)
    cfg["train_batch_size"] = a.global_batch
    cfg["train_micro_batch_size_per_gpu"] = a.micro_batch
    cfg["gradient_accumulation_steps"] = a.global_batch // (a.micro_batch * a.data_parallel)
    cfg["zero_optimization"] = {**cfg.get("zero_optimization", {}), "stage": a.zero_stage}
    if a.zero_stage:
        cfg["zero_allow_untested_optimizer"] = True       # Megatron-DeepSpeed's torch Adam under ZeRO
    if a.bf16:
        cfg["bf16"] = {"enabled": True}
    if a.fp16:
        # DeepSpeed's dynamic loss scale, a short window so the 20 iterations both lower and raise it
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 5,
                       "hysteresis": 2, "min_loss_scale": 1}
    path = os.path.join(a.outdir, "ds_config.json")
    with open(path, "w") as fh:
        json.dump(cfg, fh, indent=2)
    return path


def parse_losses(log_path, out_path):
    rows = []
    with open(log_path, errors="replace") as fh:
        for line in fh:
            m = ITER_RE.search(line)
            if m:
                it, ms, lr, loss = m.groups()
                scale, skipped = SCALE_RE.search(line), SKIPPED_RE.search(line)
                rows.append((int(it), loss, lr, ms, scale.group(1) if scale else "-",
                             skipped.group(1) if skipped else "-"))
    with open(out_path, "w") as fh:
        fh.write("iteration\tlm_loss\tlearning_rate\tms_per_iteration\tloss_scale\tskipped\n")
        for row in rows:
            fh.write("\t".join(str(x) for x in row) + "\n")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("outdir")
    ap.add_argument("--chimera", action="store_true", help="MDS_CHIMERA=1: import ds_chimera in every rank")
    ap.add_argument("--iters", type=int, default=20)
    # micro-batch 1: Megatron-DeepSpeed HEAD's non-flash attention path fails for micro-batch > 1 (README.md)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--global-batch", type=int, default=8)
    precision = ap.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true")
    precision.add_argument("--fp16", action="store_true",
                           help="Megatron's --fp16 with DeepSpeed's dynamic loss scale (and the CPU fp16 shim)")
    ap.add_argument("--zero-stage", type=int, default=0, choices=(0, 1))
    ap.add_argument("--data-parallel", type=int, default=1, choices=(1, 2, 4))
    ap.add_argument("--tensor-parallel", type=int, default=1, choices=(1, 2, 4),
                    help="Megatron's --tensor-model-parallel-size; the pipeline takes the other ranks")
    ap.add_argument("--save")
    ap.add_argument("--load")
    ap.add_argument("--save-interval", type=int)
    ap.add_argument("--port", type=int, default=29517)
    ap.add_argument("--timeout", type=int, default=900, help="seconds before the launch is killed")
    ap.add_argument("--workdir", default=os.environ.get("MDS_WORKDIR", "/tmp/mds"))
    ap.add_argument("--project", default=PROJECT,
                    help="directory holding the ds_chimera package for --chimera (default: this checkout)")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    a.extra = argv[cut + 1:]          # after --: more pretrain_gpt.py arguments
    a.outdir = os.path.abspath(a.outdir)
    os.makedirs(a.outdir, exist_ok=True)
    repo = os.path.join(os.path.abspath(a.workdir), "Megatron-DeepSpeed")
    if not os.path.exists(os.path.join(a.workdir, "data", "corpus_text_document.idx")):
        sys.exit(f"run prepare.py first (no dataset under {a.workdir})")
    write_config(a)

    env = dict(os.environ)
    # this dir first (sitecustomize), then the repo so its top-level `megatron` shadows megatron-core's namespace
    # package, then the project (ds_chimera, imported only with --chimera)
    env["PYTHONPATH"] = os.pathsep.join([HERE, repo, os.path.abspath(a.project)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["MDS_CHIMERA"] = "1" if a.chimera else "0"
    env["MDS_FP16_ON_CPU"] = "1" if a.fp16 else "0"
    # --no_local_rank: Megatron asserts local_rank == rank % device_count, and the CPU accelerator counts 1 device
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(RANKS), "--no_local_rank",
           "--master_port", str(a.port), os.path.join(repo, "pretrain_gpt.py")] + model_args(a, a.workdir)
    with open(os.path.join(a.outdir, "cmd.txt"), "w") as fh:
        fh.write(f"MDS_CHIMERA={env['MDS_CHIMERA']} MDS_FP16_ON_CPU={env['MDS_FP16_ON_CPU']} PYTHONPATH={env['PYTHONPATH']} DS_ACCELERATOR=cpu "
                 f"OMP_NUM_THREADS=1 " + " ".join(cmd) + "\n")

    shm_before = set(glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"))
    log_path = os.path.join(a.outdir, "log.txt")
    start = time.time()
    with open(log_path, "w") as log:
        # cwd = OUTDIR: pretrain_gpt.py runs `git rev-parse` for its banner; keep it off /work/main's repo
        proc = subprocess.Popen(cmd, env=env, cwd=a.outdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            deadline = start + a.timeout
            for line in proc.stdout:
                log.write(line)
                if ITER_RE.search(line) or "Error" in line or "Traceback" in line:
                    print(line.rstrip()[:300], flush=True)
                if time.time() > deadline:
                    raise TimeoutError
            rc = proc.wait()
        except (TimeoutError, KeyboardInterrupt):
            os.killpg(proc.pid, signal.SIGTERM)
            time.sleep(3)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            rc = 124
    # DeepSpeed's CPU accelerator leaves a shared-memory buffer per rank; remove only the ones this launch made
    for path in set(glob.glob("/dev/shm/deepspeed_allreduce_buffer_*")) - shm_before:
        try:
            os.remove(path)
        except OSError:
            pass
    rows = parse_losses(log_path, os.path.join(a.outdir, "loss.tsv"))
    print(f"rc={rc} wall={time.time() - start:.1f}s iterations={len(rows)} "
          f"first_loss={rows[0][1] if rows else None} last_loss={rows[-1][1] if rows else None} -> {a.outdir}")
    sys.exit(rc)


if __name__ == "__main__":
    main()
