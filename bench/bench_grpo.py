"""GRPO throughput of scripts/kat_train_grpo (the real trainer, in-process), printed as one JSON line.
Defaults match ../shared/anchor-bench/trl_grpo.py: per process per step 1 prompt x 8 completions of
exactly 32 new tokens, temperature 1, beta 0.04 with a reference model, token-level loss (TRL's
"dapo"), clip 0.2, lr 1e-6, exact-match reward, 40 steps of which the first 5 are not timed.

    python bench/bench_grpo.py --policy ASSETS/tiny-llama --prompts ASSETS/prompts.jsonl --threads 2
    torchrun --standalone --nproc_per_node 2 bench/bench_grpo.py --policy ... --prompts ... --threads 1
"""
import argparse
import json
import os
import resource
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads per process")
    p.add_argument("--prompts_per_proc", type=int, default=1)
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--new_tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5, help="leading steps left out of the timing")
    p.add_argument("--device", default="cpu")
    p.add_argument("--compile", default="0", choices=("0", "1"), help="kat_train_grpo --compile")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"), help="kat_train_grpo --dtype")
    p.add_argument("--async_rollouts", default="0", choices=("0", "1"),
                   help="kat_train_grpo --async_rollouts (1: the next rollout sampled in a thread while a step trains)")
    b = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(b.threads)
    import torch

    torch.set_num_threads(b.threads)
    from nanochat_ext.ddp_common import all_reduce_max, dist_session
    from nanochat_ext.runtime.progress import Progress
    from nanochat_ext.runtime.session import Session
    from scripts import kat_train_grpo

    world = int(os.environ.get("WORLD_SIZE", 1))
    out = tempfile.mkdtemp(prefix="bench_grpo_")
    argv = ["--policy", b.policy, "--prompts", b.prompts, "--reward_fn", "nanochat_ext.tasks.reward_fns:exact_match",
            "--batch_size", str(b.prompts_per_proc * world), "--group_size", str(b.group_size),
            "--max_new_tokens", str(b.new_tokens), "--min_new_tokens", str(b.new_tokens), "--temperature", "1.0",
            "--beta", "0.04", "--loss_agg", "token", "--clip_eps", "0.2", "--lr", "1e-6", "--max_steps", str(b.steps),
            "--log_every", str(b.warmup), "--val_ratio", "0", "--device", b.device, "--out", out,
            "--compile", b.compile, "--dtype", b.dtype, "--async_rollouts", b.async_rollouts]
    if b.tokenizer:
        argv += ["--tokenizer", b.tokenizer]
    args = kat_train_grpo.parse_args(argv)
    with dist_session(args.device) as env:
        kat_train_grpo.train(args, Session(env, Progress()))
        rss_mb = all_reduce_max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        if not env.is_main:
            return
        logs = [json.loads(line) for line in open(Path(out) / "logs" / "metrics.jsonl")]
        windows = [r for r in logs if "perf/completions_per_s" in r and r["step"] > b.warmup]
        # each window's steps: --steps need not be a multiple of --warmup (the log interval), so the last may be short
        sizes = [r["step"] - prev for r, prev in zip(windows, [b.warmup] + [r["step"] for r in windows])]
        per_step = b.prompts_per_proc * b.group_size * world
        secs = sum(n * per_step / r["perf/completions_per_s"] for n, r in zip(sizes, windows))
        gen_secs = sum(n * per_step * b.new_tokens / r["perf/gen_tokens_per_s"] for n, r in zip(sizes, windows))
        train_tokens_s = sum(r["perf/train_tokens_per_s"] for r in windows) / len(windows)
        steps = sum(sizes)
        completions, gen_tokens = steps * per_step, steps * per_step * b.new_tokens
        compile_s = sum(r.get("perf/compile_s", 0.0) for r in logs)  # the first step's is in the untimed warmup
        print(json.dumps({
            "bench": "nanochat_ext_grpo", "compile": b.compile, "dtype": b.dtype, "world_size": env.world_size,
            "async_rollouts": int(b.async_rollouts),
            "threads_per_proc": torch.get_num_threads(),
            "completions_per_step_global": b.prompts_per_proc * b.group_size * world, "steps_timed": steps,
            "timed_s": round(secs, 3), "completions_per_s": round(completions / secs, 2),
            "gen_tokens_per_s": round(gen_tokens / gen_secs, 1),
            "train_tokens_per_s": round(train_tokens_s, 1), "ms_per_step": round(1000 * secs / steps, 1),
            "ms_gen_per_step": round(1000 * gen_secs / steps, 1), "compile_s": round(compile_s, 1),
            "peak_rss_mb_max_proc": round(rss_mb, 1),
            "torch": torch.__version__,
        }), flush=True)


if __name__ == "__main__":
    main()
