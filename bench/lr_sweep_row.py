"""One run of bench/lr_sweep.sh as a JSON line on stdout: what the run's metrics.jsonl (and, for DPO and SFT, the
sweep's kat_eval report) say about it. A "_last" training figure is the last one logged: the mean over its logging
window (--log_every steps; SFT logs every 20, so an 8-step run's is the mean of all 8).

    python bench/lr_sweep_row.py rm RUN LR MODE STEPS BATCH
    python bench/lr_sweep_row.py grpo RUN LR
    python bench/lr_sweep_row.py dpo|sft RUN LR REPORT_JSON
"""
import json
import sys
from pathlib import Path


def metrics(run: str) -> list[dict]:
    return [json.loads(line) for line in (Path(run) / "logs" / "metrics.jsonl").read_text().splitlines()]


def column(rows: list[dict], key: str) -> list:
    return [r[key] for r in rows if key in r]


def rm(rows: list[dict], mode: str, steps: str, batch: str) -> dict:
    val = [r for r in rows if "val/accuracy" in r][-1]
    loss = column(rows, "train/loss")
    return {"unfreeze_last": mode, "steps": int(steps), "batch_size": int(batch), "val_accuracy": val["val/accuracy"],
            "val_loss": val.get("val/loss"), "train_loss_first": loss[0], "train_loss_last": loss[-1]}


def grpo(rows: list[dict]) -> dict:
    evals = [(r["step"], r["eval/reward_greedy"]) for r in rows if "eval/reward_greedy" in r]
    reward, entropy = column(rows, "train/reward"), column(rows, "train/entropy")
    return {"steps": len(reward), "eval_greedy": evals, "best": max(a for _, a in evals), "last": evals[-1][1],
            "train_reward_last10": sum(reward[-10:]) / len(reward[-10:]),
            "entropy_first": entropy[0], "entropy_last5": sum(entropy[-5:]) / len(entropy[-5:]),
            "grad_norm_max": max(column(rows, "train/grad_norm"))}


def evaluated(rows: list[dict], lr: str, report: str) -> dict:
    """The trainer's last logged loss beside the held-out evaluation of its policy (and of the model before)."""
    policies = json.loads(Path(report).read_text())["policies"]
    mine, before = policies[f"lr {lr}"], policies["before"]
    keys = ("task_accuracy_greedy", "task_accuracy_sampled", "task_accuracy_greedy_rare", "completion_len")
    out = {"train_loss_last": column(rows, "train/loss")[-1],
           "grad_norm_max": max(column(rows, "train/grad_norm")),
           **{k: mine[k] for k in keys if k in mine}, **{f"before_{k}": before[k] for k in keys if k in before}}
    if margins := column(rows, "rewards/margins"):  # DPO's own view of its pairs
        out |= {"margin_last": margins[-1], "pair_accuracy_last": column(rows, "rewards/accuracies")[-1],
                "logps_chosen_last": column(rows, "logps/chosen")[-1]}
    if mine.get("tool_use"):
        out |= {"tool_use": mine["tool_use"], "before_tool_use": before["tool_use"]}
    return out


if __name__ == "__main__":
    method, run, lr, *rest = sys.argv[1:]
    rows = metrics(run)
    row = {"rm": lambda: rm(rows, *rest), "grpo": lambda: grpo(rows),
           "dpo": lambda: evaluated(rows, lr, *rest), "sft": lambda: evaluated(rows, lr, *rest)}[method]()
    print(json.dumps({"method": method, "lr": float(lr), **row}))
