"""Train a small Megatron-Core GPT with a ds_chimera schedule: a Megatron-style training loop.

On CPU (4 gloo processes), with the schedule chosen on the command line:

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 4 examples/megatron_gpt.py --pipeline-schedule chimera

or with the launcher flag, which needs no ds_chimera call in the script at all:

    ds-chimera launch --torchrun --pipeline-schedule zbv --nproc_per_node 4 examples/megatron_gpt.py

The loop is Megatron's: it asks ``megatron.core.pipeline_parallel.get_forward_backward_func()``
for the schedule, gives it ``forward_step_func`` (returning ``(output, loss_func)``) and the
model chunks, then steps the optimizer. ``ds_chimera.megatron.install`` routes that call to
the chosen schedule; ``build_model_chunks`` builds the chunks the schedule places on each
rank (two replicas' stages for Chimera). The data is generated: each sequence counts up by a
fixed stride, so the loss falls within a few dozen steps.
"""
import argparse
import os
import time
import warnings

warnings.filterwarnings("ignore", module="megatron")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ds_chimera.megatron as dsm  # noqa: E402

SCHEDULE = dsm.install() or dsm.install("1f1b")      # --pipeline-schedule NAME, else 1f1b (Megatron's needs CUDA)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--pipeline-parallel", type=int, default=None, help="default: the world size")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seq-length", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    return parser.parse_args()


def counting_batches(args, dp_rank: int):
    """Endless micro-batches of (tokens, labels): x[t+1] = x[t] + stride (mod vocab)."""
    g = torch.Generator().manual_seed(17 + dp_rank)
    steps = torch.arange(args.seq_length + 1)
    while True:
        start = torch.randint(0, args.vocab, (args.micro_batch_size, 1), generator=g)
        stride = torch.randint(1, 4, (args.micro_batch_size, 1), generator=g)
        seq = (start + stride * steps) % args.vocab
        yield seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def main():
    args = parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dsm.enable_cpu()
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    pp = args.pipeline_parallel or dist.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=pp)
    forward_backward = get_forward_backward_func()
    schedule, options = forward_backward.schedule, forward_backward.options
    config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4,
                               use_cpu_initialization=True, pipeline_dtype=torch.float32, hidden_dropout=0.0,
                               attention_dropout=0.0, pipeline_model_parallel_size=pp,
                               virtual_pipeline_model_parallel_size=dsm.virtual_stages(schedule, pp, **options))
    device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")

    def model_provider(pre_process=True, post_process=True, vp_stage=None):
        return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.vocab,
                        max_sequence_length=args.seq_length, pre_process=pre_process, post_process=post_process,
                        vp_stage=vp_stage).to(device)

    chunks = dsm.build_model_chunks(model_provider, schedule, **options)
    params = [p for chunk in chunks for p in chunk.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    dp_group, dp = parallel_state.get_data_parallel_group(), parallel_state.get_data_parallel_world_size()

    def finalize_model_grads(model, num_tokens=None, **kwargs):
        """Megatron DDP's job here: average gradients over data-parallel replicas."""
        if dp > 1:
            for p in params:
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=dp_group)
                    p.grad.div_(dp)
    config.finalize_model_grads_func = finalize_model_grads

    positions = torch.arange(args.seq_length, device=device).unsqueeze(0).expand(args.micro_batch_size, -1)
    mask = dsm.causal_mask(args.seq_length, device)

    def forward_step(data_iterator, model):
        tokens, labels = (t.to(device) for t in next(data_iterator))
        output = model(tokens, positions, mask, labels=labels)

        def loss_func(per_token_loss):
            loss = per_token_loss.float().mean()
            # a copy, as Megatron-LM's own loss_func: the schedule divides the loss in place
            return loss, {"lm loss": loss.detach().clone()}
        return output, loss_func

    data = counting_batches(args, parallel_state.get_data_parallel_rank())
    rank = dist.get_rank()
    if rank == 0:
        print(f"[megatron_gpt] schedule {schedule}{' ' + str(options) if options else ''} on {pp} pipeline ranks x {dp} data-parallel, "
              f"{args.micro_batches} micro-batches of {args.micro_batch_size}", flush=True)
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        losses = forward_backward(forward_step_func=forward_step, data_iterator=data, model=chunks,
                                  num_microbatches=args.micro_batches, seq_length=args.seq_length,
                                  micro_batch_size=args.micro_batch_size)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # as under Megatron's own schedules, the dicts come back on the last pipeline rank, [] elsewhere
        mean = torch.tensor([sum(float(d["lm loss"]) for d in losses) / len(losses) if losses else -1.0], device=device)
        dist.all_reduce(mean, op=dist.ReduceOp.MAX, group=parallel_state.get_pipeline_model_parallel_group())
        if rank == 0:
            print(f"[megatron_gpt] step {step} loss {mean.item():.4f} time {time.perf_counter() - start:.3f}s",
                  flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
