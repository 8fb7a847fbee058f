"""A causal-LM fine-tuning script shaped like HF's examples/pytorch/language-modeling/run_clm.py.

Written here (not copied) for the tests: it parses ``ModelArguments`` / ``DataArguments`` /
``TrainingArguments`` with ``HfArgumentParser``, builds the model from ``--config_name`` and
the tokenizer from ``--tokenizer_name`` (local folders), tokenizes a text file and groups it
into ``--block_size`` blocks (or, with ``--line_by_line``, pads each line: padded batches),
and trains a plain ``transformers.Trainer`` with run_clm's accuracy metric
(``preprocess_logits_for_metrics`` = argmax, ``compute_metrics`` = next-token accuracy). It
knows nothing of ds_chimera: launched under ``ds-chimera launch`` with a DeepSpeed config
that has a ``"pipeline"`` section, it trains pipelined unchanged.

    python hf_clm.py --config_name CFG --tokenizer_name TOK --train_file T.txt --validation_file V.txt \
        --block_size 32 --output_dir OUT --do_train --do_eval [--deepspeed ds.json]

``main(argv)`` returns the trainer and its metrics, so a test can run several cases in one process.
"""
import logging
import math
import sys
from dataclasses import dataclass, field

import torch
import transformers
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling,
                          HfArgumentParser, Trainer, TrainingArguments, default_data_collator, set_seed)

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    config_name: str = field(metadata={"help": "folder with the model's config.json (the model starts random)"})
    tokenizer_name: str = field(metadata={"help": "folder with a saved tokenizer"})


@dataclass
class DataArguments:
    train_file: str = field(metadata={"help": "a text file, one example per line"})
    validation_file: str = field(default=None)
    block_size: int = field(default=32)
    line_by_line: bool = field(default=False, metadata={"help": "one padded example per line instead of blocks"})
    max_eval_samples: int = field(default=None)


class TextDataset(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def read_lines(path):
    with open(path) as fh:
        return [line.strip() for line in fh if line.strip()]


def blocks(tokenizer, lines, size):
    """run_clm's group_texts: concatenate everything, cut into size-token blocks, labels = input_ids."""
    ids = [t for line in lines for t in tokenizer(line)["input_ids"]]
    total = (len(ids) // size) * size
    return [{"input_ids": ids[i:i + size], "attention_mask": [1] * size, "labels": ids[i:i + size]}
            for i in range(0, total, size)]


def padded_lines(tokenizer, lines, size):
    return [{k: v for k, v in tokenizer(line, truncation=True, max_length=size).items() if k != "token_type_ids"}
            for line in lines]


def preprocess_logits_for_metrics(logits, labels):
    if isinstance(logits, tuple):
        logits = logits[0]
    return logits.argmax(dim=-1)


def compute_metrics(eval_preds):
    """run_clm's metric: next-token accuracy (predictions shifted against labels), scored labels only."""
    preds, labels = eval_preds
    labels, preds = labels[:, 1:].reshape(-1), preds[:, :-1].reshape(-1)
    scored = labels != -100
    return {"accuracy": float((preds[scored] == labels[scored]).mean())}


def main(argv=None):
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", handlers=[
        logging.StreamHandler(sys.stdout)])
    if training_args.should_log:
        transformers.utils.logging.set_verbosity_info()
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    logger.warning(f"Process rank: {training_args.process_index}, device: {training_args.device}, "
                   f"distributed training: {training_args.parallel_mode.value == 'distributed'}")

    set_seed(training_args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name)
    config = AutoConfig.from_pretrained(model_args.config_name)
    model = AutoModelForCausalLM.from_config(config)

    make = padded_lines if data_args.line_by_line else blocks
    with training_args.main_process_first(desc="tokenizing"):
        train = TextDataset(make(tokenizer, read_lines(data_args.train_file), data_args.block_size))
        evals = TextDataset(make(tokenizer, read_lines(data_args.validation_file or data_args.train_file),
                                 data_args.block_size))
    if data_args.max_eval_samples is not None:
        evals = TextDataset(evals.rows[:data_args.max_eval_samples])
    collator = (DataCollatorForLanguageModeling(tokenizer, mlm=False) if data_args.line_by_line
                else default_data_collator)

    trainer = Trainer(model=model, args=training_args, train_dataset=train if training_args.do_train else None,
                      eval_dataset=evals if training_args.do_eval else None, processing_class=tokenizer,
                      data_collator=collator,
                      compute_metrics=compute_metrics if training_args.do_eval else None,
                      preprocess_logits_for_metrics=preprocess_logits_for_metrics if training_args.do_eval else None)
    results = {}
    if training_args.do_train:
        output = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        metrics = dict(output.metrics, train_samples=len(train))
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        results["train"] = metrics
    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(evals)
        metrics["perplexity"] = math.exp(metrics["eval_loss"]) if metrics["eval_loss"] < 50 else float("inf")
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        results["eval"] = metrics
    return trainer, results


if __name__ == "__main__":
    main()
