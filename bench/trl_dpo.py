"""CPU throughput of TRL's DPOTrainer on the anchor bench's tiny Llama: the peer of `bench/bench_rm.py --trainer dpo`,
set as
../shared/anchor-bench/trl_rm.py sets the reward trainer (fp32, 16 pairs a process a step, max_length 128, no
activation checkpointing), with DPO's own defaults otherwise (sigmoid loss, beta 0.1, the reference a frozen copy
of the policy computed on the fly with each batch, as ours does by default). Run it with the venv TRL is installed
in (../shared/anchor-bench/README.md), from that folder (its benchlib):

    cd ../shared/anchor-bench && ANCHOR_VENV/bin/python /path/to/bench/trl_dpo.py --threads 2
    cd ../shared/anchor-bench && ANCHOR_VENV/bin/torchrun --nproc_per_node 2 /path/to/bench/trl_dpo.py --threads 1

Last stdout line: one JSON record.
"""
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.getcwd())  # the anchor bench's benchlib
from benchlib import (  # noqa: E402
    ASSETS,
    all_max,
    all_sum,
    finish,
    make_step_timer,
    parse_and_set_threads,
    peak_rss_mb,
    read_jsonl,
    versions,
    world,
)

args = parse_and_set_threads(steps=60, warmup=5)

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402

BATCH = 16


class TimedDPOTrainer(DPOTrainer):
    """Records the real (non-pad) token count of every training batch (chosen and rejected rows)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.tok_real = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training:
            self.tok_real.append(int(inputs["attention_mask"].sum()))
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def main():
    model_dir = str(ASSETS / "tiny-llama")
    set_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    train = Dataset.from_list(read_jsonl("pairs.jsonl"))
    cfg = DPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_dpo_"),
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=1,
        max_steps=args.steps,
        max_length=128,
        learning_rate=1e-6,
        beta=0.1,
        bf16=False,
        gradient_checkpointing=False,
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        seed=args.seed,
        ddp_find_unused_parameters=False,
        use_cpu=True,  # required for torchrun/gloo (see trl_rm.py)
    )
    timer = make_step_timer()
    trainer = TimedDPOTrainer(model=model, args=cfg, train_dataset=train, processing_class=tok, callbacks=[timer])
    t0 = time.perf_counter()
    trainer.train()
    total_s = time.perf_counter() - t0
    assert cfg.world_size == int(os.environ.get("WORLD_SIZE", 1)), "launcher started N procs but Trainer is not DDP"

    rank, ws = world()
    w = args.warmup
    secs = all_max(timer.window(w))
    n = args.steps - w
    pairs = n * BATCH * ws
    real = all_sum(sum(trainer.tok_real[w:]))
    rss = all_max(peak_rss_mb())
    rec = {
        "bench": "trl_dpo", "world_size": ws, "threads_per_proc": timer.threads, "steps_timed": n,
        "wrapper": type(trainer.model_wrapped).__name__, "pairs_per_step_global": BATCH * ws,
        "timed_s": round(secs, 3), "train_call_s": round(total_s, 3),
        "pairs_per_s": round(pairs / secs, 2), "tokens_per_s": round(real / secs, 1),
        "ms_per_step": round(1000 * secs / n, 2), "peak_rss_mb_max_proc": rss, "versions": versions(),
    }
    if rank == 0:
        print(json.dumps(rec), flush=True)
    finish()


if __name__ == "__main__":
    main()
