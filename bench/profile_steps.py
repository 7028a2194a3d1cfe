"""Where the time goes: the top aten ops (self CPU time) of the real RM and GRPO trainers over a few
steps, one JSON line per trainer (the lines starting with "{"; the trainers log to stdout too). Same
tiny model and data as bench_rm.py / bench_grpo.py.

    python bench/profile_steps.py --backbone ASSETS/tiny-llama --pairs ASSETS/pairs.jsonl --prompts ASSETS/prompts.jsonl
"""
import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def top_ops(prof, n: int) -> dict:
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return {"total_ms": round(total / 1000, 1), "ops_called": sum(e.count for e in events),
            "top": [{"op": e.key, "self_ms": round(e.self_cpu_time_total / 1000, 1), "calls": e.count,
                     "share": round(e.self_cpu_time_total / total, 3)} for e in events[:n]]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backbone", required=True)
    p.add_argument("--pairs", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=8)
    b = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(b.threads)
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(b.threads)
    from nanochat_ext.ddp_common import dist_session
    from nanochat_ext.runtime.progress import Progress
    from nanochat_ext.runtime.session import Session
    from scripts import kat_train_grpo, kat_train_rm

    runs = {
        "rm_full_finetune": (kat_train_rm, ["--backbone", b.backbone, "--pairs", b.pairs, "--batch_size", "16",
                                            "--max_len", "128", "--unfreeze_last", "all", "--eval_every", "0",
                                            "--val_ratio", "0"]),
        "grpo": (kat_train_grpo, ["--policy", b.backbone, "--prompts", b.prompts, "--reward_fn",
                                  "nanochat_ext.tasks.reward_fns:exact_match", "--batch_size", "1", "--group_size", "8",
                                  "--max_new_tokens", "32", "--min_new_tokens", "32", "--beta", "0.04",
                                  "--val_ratio", "0"]),
    }
    for name, (script, argv) in runs.items():
        args = script.parse_args(argv + ["--max_steps", str(b.steps), "--log_every", "0", "--device", "cpu",
                                         "--out", tempfile.mkdtemp(prefix=f"profile_{name}_")])
        with dist_session("cpu") as env, profile(activities=[ProfilerActivity.CPU]) as prof:
            script.train(args, Session(env, Progress()))
        print(json.dumps({"bench": "profile", "trainer": name, "steps": b.steps, "threads": b.threads,
                          **top_ops(prof, b.top), "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
