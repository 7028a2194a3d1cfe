"""TRL 1.16's RewardTrainer on a real model and a task's preference pairs: pairs/s, as bench/bench_rm.py measures
ours (run with the TRL venv, ../shared/anchor-bench/README.md). A full fine-tune, fp32, no activation checkpointing,
PAIRS pairs a step in one right-padded forward of chosen and rejected, max length 128, AdamW lr 1e-4, grad clip 1
(--bf16: bf16 mixed precision, as ours runs with --dtype bfloat16);
the pairs are conversational (scripts/kat_task_data's pairs.jsonl), so both sides render them with the model's
chat template. The last stdout line is one JSON record.

    /tmp/anchor-venv/bin/python bench/trl_real_rm.py --model MODEL_DIR --task TASK_DIR [--steps 20] [--warmup 3]
"""
import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--task", required=True, help="a dir with pairs.jsonl")
p.add_argument("--pairs", type=int, default=8, help="pairs a step")
p.add_argument("--steps", type=int, default=20)
p.add_argument("--warmup", type=int, default=3, help="leading steps left out of the timing")
p.add_argument("--threads", type=int, default=2)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (TRL's default; fp32 without)")
args = p.parse_args()
for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # before torch loads
    os.environ[var] = str(args.threads)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback, set_seed  # noqa: E402
from trl import RewardConfig, RewardTrainer  # noqa: E402


class StepTimes(TrainerCallback):
    def __init__(self):
        self.ends, self.begin = [], None

    def on_step_begin(self, *a, **kw):
        if self.begin is None:
            self.begin = time.perf_counter()

    def on_step_end(self, *a, **kw):
        self.ends.append(time.perf_counter())


def main() -> None:
    torch.set_num_threads(args.threads)
    transformers.utils.logging.set_verbosity_error()
    set_seed(args.seed)  # the score head is new
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1, dtype="float32")
    model.config.pad_token_id = tok.pad_token_id
    rows = [json.loads(line) for line in (Path(args.task) / "pairs.jsonl").read_text().splitlines()]
    cfg = RewardConfig(output_dir=tempfile.mkdtemp(prefix="trl_real_rm_"), per_device_train_batch_size=args.pairs,
                       gradient_accumulation_steps=1, max_steps=args.steps, max_length=128, learning_rate=1e-4,
                       max_grad_norm=1.0, bf16=args.bf16, activation_checkpointing=False, logging_strategy="no",
                       save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
                       dataloader_pin_memory=False, seed=args.seed, use_cpu=True)
    timer = StepTimes()
    trainer = RewardTrainer(model=model, args=cfg, train_dataset=Dataset.from_list(rows), processing_class=tok,
                            callbacks=[timer])
    trainer.train()
    w = args.warmup
    secs = timer.ends[-1] - timer.ends[w - 1] if w else timer.ends[-1] - timer.begin
    n = args.steps - w
    print(json.dumps({"bench": "trl_real_rm", "model": args.model, "pairs_per_step": args.pairs,
                      "bf16": args.bf16, "steps_timed": n,
                      "pairs_per_s": round(n * args.pairs / secs, 3), "ms_per_step": round(1000 * secs / n, 1),
                      "threads": args.threads,
                      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                      "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                                   "trl": trl.__version__}}), flush=True)


if __name__ == "__main__":
    main()
