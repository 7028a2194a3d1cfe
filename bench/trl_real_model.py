"""TRL's GRPOTrainer on a real model and a verifiable task (bench/bench_real_model.sh runs it beside ours). Run it
with the venv TRL is installed in (../shared/anchor-bench/README.md), not ours:

    TRL_PY bench/trl_real_model.py --model MODEL_DIR --task TASK_DIR --mode throughput [--steps 40 --warmup 5]
    TRL_PY bench/trl_real_model.py --model MODEL_DIR --task TASK_DIR --mode time_to_accuracy \
        [--steps 40 --eval_every 10]

TASK_DIR holds train.jsonl and eval.jsonl ({prompt, answer}, as scripts/kat_task_data writes them); every prompt goes
through the model's chat template (TRL's conversational format), and completions are scored by our `last_number`
(nanochat_ext/tasks/reward_fns.py, imported: one definition for both trainers).

throughput: per step 1 prompt x 8 completions of exactly 32 new tokens (min_new_tokens), temperature 1, beta 0.04
  with a frozen reference, lr 1e-6, fp32: ../shared/anchor-bench/trl_grpo.py's settings, which bench/bench_grpo.py
  defaults to. The first --warmup steps are not timed. Last stdout line: one JSON record.
time_to_accuracy: TRL set as close to kat_train_grpo's real-model recipe (speedrun.sh MODEL=smollm2) as its options
  allow (SETTINGS below; bench/bench_real_model.sh's header lists what differs). After step 0 and every --eval_every
  steps (and the last) a callback measures greedy accuracy on eval.jsonl; training seconds so far leave the
  evaluations out. Stdout: one JSON line per evaluation, then a summary line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # nanochat_ext's reward_fns (standard library only)

GROUP = 8  # completions per prompt in both modes

# time_to_accuracy: kat_train_grpo --batch_size 4 --group_size 8 --max_new_tokens 16 --lr 3e-5 --beta 0 in TRL's
# words. Our defaults it matches: loss_agg token (TRL's "dapo": over the batch's completion tokens), scale_rewards
# group with the sample std, clip_eps 0.2 both sides, one update per rollout, temperature 1, top_k/top_p off;
# AdamW (fused on CPU) betas (0.9, 0.95), eps 1e-8, weight decay 0, grad clip 1.0 (nanochat_ext/training/optim.py); no
# warmup, cosine from the peak lr to 0.1x at the last step (optim.lr_multiplier: transformers' cosine_with_min_lr with
# min_lr_rate 0.1 computes the same multiplier at every step when warmup is 0).
SETTINGS = dict(per_device_train_batch_size=4 * GROUP, num_generations=GROUP, gradient_accumulation_steps=1,
                max_completion_length=16, temperature=1.0, top_p=1.0, top_k=0, beta=0.0, learning_rate=3e-5,
                loss_type="dapo", scale_rewards="group", epsilon=0.2, num_iterations=1,
                mask_truncated_completions=False,
                optim="adamw_torch_fused", adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=0.0,
                max_grad_norm=1.0, lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1},
                warmup_steps=0)
THROUGHPUT = dict(per_device_train_batch_size=GROUP, num_generations=GROUP, gradient_accumulation_steps=1,
                  max_completion_length=32, generation_kwargs={"min_new_tokens": 32}, temperature=1.0, beta=0.04,
                  learning_rate=1e-6)


def fail(line: str) -> None:
    """Bad input: one `error: ...` line on stderr and exit 2, as our scripts do (nanochat_ext/cli.py)."""
    sys.stderr.write(f"error: {line}\n")
    sys.exit(2)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a Hugging Face model dir (with its tokenizer and chat template)")
    p.add_argument("--task", required=True, help="a dir with train.jsonl and eval.jsonl")
    p.add_argument("--mode", required=True, choices=("throughput", "time_to_accuracy"))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5, help="throughput: leading steps left out of the timing")
    p.add_argument("--eval_every", type=int, default=10, help="time_to_accuracy: evaluate every N steps")
    p.add_argument("--eval_batch", type=int, default=32, help="eval prompts per generate call (ours: a rollout's rows)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: bf16 mixed precision, as ours computes on CUDA (bench/run_gpu.sh); cpu: fp32")
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision on CPU too (ours: --dtype bfloat16)")
    args = p.parse_args()
    for name in ("train.jsonl", "eval.jsonl"):
        if not (Path(args.task) / name).is_file():
            fail(f"--task {args.task}: no {name} (python -m scripts.kat_task_data --out DIR writes both)")
    config_file = Path(args.model) / "config.json"
    if not config_file.is_file():
        fail(f"--model {args.model}: no config.json (a Hugging Face model dir)")
    if "quantization_config" in json.loads(config_file.read_text()):  # even dequantized: transformers' Trainer
        fail(f"--model {args.model}: config.json has a quantization_config, and TRL's Trainer refuses to "
                 f"fine-tune a quantized model; scripts/kat_fetch_model writes the model without one")
    if args.mode == "throughput" and not 0 <= args.warmup < args.steps:
        fail(f"--warmup must be 0..--steps - 1 ({args.steps - 1}), got {args.warmup}")
    if args.steps < 1 or args.eval_every < 1:
        fail("--steps and --eval_every must be >= 1")
    return args


ARGS = parse_args()
for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # before torch loads: OpenMP reads them once
    os.environ[var] = str(ARGS.threads)
for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(var, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import datasets  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, TrainerCallback, set_seed  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from nanochat_ext.tasks.reward_fns import last_number  # noqa: E402

torch.set_num_threads(ARGS.threads)
datasets.disable_progress_bars()
transformers.utils.logging.set_verbosity_error()


def read_rows(path: Path) -> list[dict]:
    """{prompt: str | [messages], answer} rows as TRL's conversational dataset: the prompt as messages."""
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            prompt = r["prompt"] if isinstance(r["prompt"], list) else [{"role": "user", "content": r["prompt"]}]
            rows.append({"prompt": prompt, "answer": str(r["answer"])})
    return rows


def reward_last_number(prompts, completions, answer, **kwargs) -> list[float]:
    """TRL's reward signature around ours: a conversational completion is a list holding the assistant message."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [last_number("", t, {"answer": a}) for t, a in zip(texts, answer)]


class TimedGRPOTrainer(GRPOTrainer):
    """Seconds inside generate() and the tokens it produced, per step (throughput's gen_tokens_per_s)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.gen_s, self.gen_tokens = [], []

    def _generate_single_turn(self, prompt_ids, *a, **kw):
        t = time.perf_counter()
        completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *a, **kw)
        self.gen_s.append(time.perf_counter() - t)
        self.gen_tokens.append(sum(len(c) for c in completion_ids))
        return completion_ids, logprobs


class StepClock(TrainerCallback):
    """perf_counter at train begin and after every optimizer step; the lr each step used."""

    def __init__(self):
        self.t, self.lrs = [], []

    def on_train_begin(self, args, state, control, **kw):
        self.t = [time.perf_counter()]

    def on_step_begin(self, args, state, control, optimizer=None, **kw):
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def on_step_end(self, args, state, control, **kw):
        self.t.append(time.perf_counter())


class GreedyAccuracy(TrainerCallback):
    """Held-out greedy accuracy after step 0 (at train begin), every `every` steps and the last: model.generate without
    sampling, left-padded batches through the chat template, scored by last_number. Training seconds so far are the
    wall-clock since train begin less the evaluations' own time."""

    def __init__(self, tok, rows: list[dict], every: int, max_new: int, batch: int, clock: StepClock):
        self.tok, self.rows, self.every, self.batch, self.clock = tok, rows, every, batch, clock
        self.gen = GenerationConfig(max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id,
                                    eos_token_id=None, bos_token_id=tok.bos_token_id)
        self.t0, self.eval_s, self.records = 0.0, 0.0, []

    @torch.no_grad()
    def accuracy(self, model) -> float:
        was_training = model.training
        model.eval()
        correct = 0.0
        for i in range(0, len(self.rows), self.batch):
            part = self.rows[i:i + self.batch]
            texts = [self.tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
                     for r in part]
            enc = self.tok(texts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
            out = model.generate(**enc, generation_config=self.gen)
            replies = self.tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            correct += sum(last_number("", t, {"answer": r["answer"]}) for t, r in zip(replies, part))
        model.train(was_training)
        return correct / len(self.rows)

    def evaluate(self, model, step: int) -> None:
        t = time.perf_counter()
        train_s = t - self.t0 - self.eval_s
        acc = self.accuracy(model)
        self.eval_s += time.perf_counter() - t
        rec = {"bench": "trl_time_to_accuracy", "step": step, "train_s": round(train_s, 3), "greedy_accuracy": acc,
               "lr": self.clock.lrs[-1] if step else None}
        self.records.append(rec)
        print(json.dumps(rec), flush=True)

    def on_train_begin(self, args, state, control, model=None, **kw):
        self.gen.eos_token_id = model.generation_config.eos_token_id  # TRL's stops: the model's, and the tokenizer's
        self.t0 = time.perf_counter()
        self.evaluate(model, 0)

    def on_step_end(self, args, state, control, model=None, **kw):
        if state.global_step % self.every == 0 or state.global_step == args.max_steps:
            self.evaluate(model, state.global_step)


def config(settings: dict, args: argparse.Namespace) -> GRPOConfig:
    """TRL's config around `settings`, the mode's own: fp32 on CPU (bf16 with --bf16) and bf16 on CUDA, no activation
    checkpointing (TRL defaults to bf16 and to checkpointing), generate() without vLLM, no logging, saving or TRL
    evaluation."""
    return GRPOConfig(output_dir=tempfile.mkdtemp(prefix="trl_real_model_"), max_steps=args.steps, use_vllm=False,
                      bf16=args.device == "cuda" or args.bf16, activation_checkpointing=False, logging_strategy="no",
                      save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
                      dataloader_pin_memory=False, seed=args.seed, use_cpu=args.device == "cpu", **settings)


def versions() -> dict:
    import accelerate
    import trl

    return {m.__name__: m.__version__ for m in (torch, transformers, trl, accelerate, datasets)}


def main() -> None:
    args = ARGS
    set_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    train = datasets.Dataset.from_list(read_rows(Path(args.task) / "train.jsonl"))
    clock = StepClock()
    callbacks = [clock]
    throughput = args.mode == "throughput"
    if not throughput:
        accuracy = GreedyAccuracy(tok, read_rows(Path(args.task) / "eval.jsonl"), args.eval_every,
                                  SETTINGS["max_completion_length"], args.eval_batch, clock)
        callbacks.append(accuracy)
    trainer = TimedGRPOTrainer(model=model, reward_funcs=reward_last_number,
                               args=config(THROUGHPUT if throughput else SETTINGS, args), train_dataset=train,
                               processing_class=tok, callbacks=callbacks)
    assert (trainer.ref_model is not None) == throughput  # beta 0.04: a frozen reference; beta 0: none
    trainer.train()
    if throughput:
        w, n = args.warmup, args.steps - args.warmup
        secs, gen_s = clock.t[-1] - clock.t[w], sum(trainer.gen_s[w:])
        completions = n * GROUP
        print(json.dumps({
            "bench": "trl_real_model_throughput", "model": args.model, "device": args.device, "bf16": args.bf16,
            "threads": torch.get_num_threads(),
            "steps_timed": n, "completions_per_step": GROUP, "timed_s": round(secs, 3),
            "completions_per_s": round(completions / secs, 3), "ms_per_step": round(1000 * secs / n, 1),
            "ms_gen_per_step": round(1000 * gen_s / n, 1),
            "gen_tokens_per_s": round(sum(trainer.gen_tokens[w:]) / gen_s, 1),
            "mean_completion_len": round(sum(trainer.gen_tokens[w:]) / completions, 2), "versions": versions(),
        }), flush=True)
        return
    last = accuracy.records[-1]
    print(json.dumps({
        "bench": "trl_time_to_accuracy_summary", "model": args.model, "threads": torch.get_num_threads(),
        "steps": args.steps, "train_s": last["train_s"], "eval_s": round(accuracy.eval_s, 3),
        "final_greedy_accuracy": last["greedy_accuracy"],
        "best_greedy_accuracy": max(r["greedy_accuracy"] for r in accuracy.records), "settings": SETTINGS,
        "versions": versions(),
    }), flush=True)


if __name__ == "__main__":
    main()
