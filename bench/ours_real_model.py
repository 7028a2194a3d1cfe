"""Our time to accuracy on a real model and a verifiable task, in the JSON lines bench/trl_real_model.py
--mode time_to_accuracy prints (bench/bench_real_model.sh runs both):

    python bench/ours_real_model.py --model MODEL_DIR --task TASK_DIR [--steps 40 --eval_every 10 --threads 2]
        [--grpo_args "--advantage rloo --scale_rewards none"]

Step 0: the starting model's held-out accuracy from nanochat_ext.algorithms.evaluation.evaluate_rewards, the function
kat_train_grpo's own --eval_every evaluations call, with the same engine, rows per call, sampling settings and seed.
Then scripts/kat_train_grpo with the real-model recipe of speedrun.sh (MODEL=smollm2), in this process:
--preset word_arithmetic (--reward_fn last_number --batch_size 4 --group_size 8 --max_new_tokens 16 --lr 3e-5 --beta 0)
--eval_every N, then --grpo_args (another estimator, a teacher: bench/methods_real_model.sh), every other flag at its
default. Its metrics.jsonl gives each evaluation's eval/last_number_greedy (and _sampled) and
perf/train_time_s at that step (training seconds so far, evaluations left out). Stdout: one JSON line per evaluation
({"bench": "ours_time_to_accuracy", "step", "train_s", "greedy_accuracy", ...}), then a summary line.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RECIPE = ["--preset", "word_arithmetic"]  # speedrun.sh's MODEL=smollm2 recipe (nanochat_ext/presets.py)
TASK_REWARD = "last_number"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the starting policy: a Hugging Face dir or a nanochat checkpoint")
    p.add_argument("--task", required=True, help="a dir with train.jsonl and eval.jsonl")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--eval_every", type=int, default=10)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grpo_args", default="", help="more kat_train_grpo flags after the recipe's, one string")
    p.add_argument("--label", default="grpo", help="the run's name in every JSON line (with its seed)")
    p.add_argument("--keep", default=None, help="train into this --out and keep it (default: a temporary dir, removed)")
    args = p.parse_args(argv)
    for name in ("train.jsonl", "eval.jsonl"):
        if not (Path(args.task) / name).is_file():
            p.exit(2, f"error: --task {args.task}: no {name} (python -m scripts.kat_task_data --out DIR writes both)\n")
    if args.steps < 1 or args.eval_every < 1:
        p.exit(2, "error: --steps and --eval_every must be >= 1\n")
    return args


def train_args(args: argparse.Namespace, out: str) -> list[str]:
    """kat_train_grpo's command line: the recipe on this model and task, this many steps."""
    task = Path(args.task)
    return ["--policy", args.model, "--prompts", str(task / "train.jsonl"), "--eval_prompts", str(task / "eval.jsonl"),
            *RECIPE, "--max_steps", str(args.steps), "--eval_every", str(args.eval_every), "--seed", str(args.seed),
            "--device", "cpu", "--out", out, *shlex.split(args.grpo_args)]


def step0(gargs: argparse.Namespace, env) -> dict:
    """The starting model's eval/<reward>_{greedy,sampled} as kat_train_grpo's evaluate() measures them after a step:
    its engine on the policy, --eval_prompts encoded for its --max_new_tokens, a rollout's rows per generate call."""
    from nanochat_ext.algorithms.evaluation import evaluate_rewards
    from nanochat_ext.algorithms.rewards import Rewards
    from nanochat_ext.data.batching import encode_prompts
    from nanochat_ext.data.rows import load_prompts
    from nanochat_ext.engine.engine import Engine
    from nanochat_ext.engine.sampling import SamplingConfig
    from nanochat_ext.models.loader import load_backbone, load_tokenizer_for
    from nanochat_ext.runtime.precision import compute_dtype, precision

    policy = load_backbone(gargs.policy, env.device)
    tok = load_tokenizer_for(policy, gargs.tokenizer)
    rows = load_prompts(gargs.eval_prompts)
    ids = encode_prompts(rows, tok.render_prompt, policy.max_seq_len, gargs.max_new_tokens, gargs.eval_prompts)
    sampling = SamplingConfig(gargs.max_new_tokens, gargs.temperature, gargs.top_k, gargs.top_p, gargs.min_new_tokens)
    rewards = Rewards(None, gargs.reward_fn, gargs.reward_weights)
    metrics, _ = evaluate_rewards(Engine(policy), rows, ids, rewards, tok, sampling, gargs.seed, env,
                                  precision(compute_dtype(gargs.dtype, env.device), env.device),
                                  gargs.batch_size * gargs.group_size // env.world_size)
    return metrics


def curve(logs: list[dict]) -> list[dict]:
    """metrics.jsonl -> (step, training seconds, held-out accuracy, lr) at each evaluation: the seconds and lr from
    the training record of the same step (kat_train_grpo logs every step by default)."""
    seconds = {r["step"]: r["perf/train_time_s"] for r in logs if "perf/train_time_s" in r}
    lrs = {r["step"]: r["train/lr"] for r in logs if "train/lr" in r}
    greedy, sampled = f"eval/{TASK_REWARD}_greedy", f"eval/{TASK_REWARD}_sampled"
    out = {}
    for r in logs:
        if greedy in r:  # the final step's evaluation is logged once (eval_every and max_steps coincide or not)
            out[r["step"]] = {"bench": "ours_time_to_accuracy", "step": r["step"],
                              "train_s": round(seconds[r["step"]], 3), "greedy_accuracy": r[greedy],
                              "sampled_accuracy": r.get(sampled), "lr": lrs.get(r["step"])}
    return [out[s] for s in sorted(out)]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    from nanochat_ext.ddp_common import dist_session
    from nanochat_ext.errors import EXIT_BAD_INPUT, InputError
    from nanochat_ext.runtime.progress import Progress
    from nanochat_ext.runtime.session import Session, say
    from scripts import kat_train_grpo

    out = args.keep or tempfile.mkdtemp(prefix="ours_real_model_")
    gargs = kat_train_grpo.parse_args(train_args(args, out))
    try:  # the trainer's progress lines go to stderr: stdout holds the JSON lines only
        with dist_session(gargs.device) as env, contextlib.redirect_stdout(sys.stderr):
            t = time.perf_counter()
            start = step0(gargs, env)
            eval0_s = time.perf_counter() - t
            t = time.perf_counter()
            kat_train_grpo.train(gargs, Session(env, Progress()))
            wall_s = time.perf_counter() - t
        logs = [json.loads(line) for line in open(Path(out) / "logs" / "metrics.jsonl")]
    except InputError as e:
        say(f"error: {e}")
        sys.exit(EXIT_BAD_INPUT)
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    run = {"label": args.label, "seed": args.seed}
    print(json.dumps({"bench": "ours_time_to_accuracy", "step": 0, "train_s": 0.0,
                      "greedy_accuracy": start[f"eval/{TASK_REWARD}_greedy"],
                      "sampled_accuracy": start[f"eval/{TASK_REWARD}_sampled"], "lr": None, **run}), flush=True)
    points = curve(logs)
    for rec in points:
        print(json.dumps({**rec, **run}), flush=True)
    print(json.dumps({**run,
        "bench": "ours_time_to_accuracy_summary", "model": args.model, "threads": torch.get_num_threads(),
        "steps": args.steps, "train_s": points[-1]["train_s"], "step0_eval_s": round(eval0_s, 3),
        "train_call_s": round(wall_s, 3), "final_greedy_accuracy": points[-1]["greedy_accuracy"],
        "best_greedy_accuracy": max([start[f"eval/{TASK_REWARD}_greedy"]] + [r["greedy_accuracy"] for r in points]),
        "recipe": " ".join(RECIPE), "grpo_args": args.grpo_args, "torch": torch.__version__,
    }), flush=True)


if __name__ == "__main__":
    main()
