"""What speedrun.sh and pipelines/*.sh ask of a run's files between stages (standard library only: no torch).

    python -m scripts.kat_pipeline stage_args OUT NAME...  # OUT: {NAME: its environment value}
                                                             (the report's stage_args)
    python -m scripts.kat_pipeline max_new_tokens DIR      # "--max_new_tokens N" of the GRPO policy trained in DIR
    python -m scripts.kat_pipeline summary REPORT [--model]  # a few lines of a report.json (the demo's, or MODEL's)
"""

import json
import os
import sys
from pathlib import Path


def stage_args(out: str, names: list[str]) -> None:
    """Write what the run was given of each setting (the regime, *_STEPS, *_ARGS...), "" where unset."""
    Path(out).write_text(json.dumps({k: os.environ.get(k, "") for k in names}))


def max_new_tokens(policy_dir: str) -> str:
    """The completion length the GRPO policy in policy_dir trained with, as its newest checkpoint records it: the
    evaluation samples at that length."""
    newest = max(Path(policy_dir).glob("meta_*.json"), key=lambda p: int(p.stem.split("_")[1]))
    return f"--max_new_tokens {json.loads(newest.read_text())['args']['max_new_tokens']}"


def summary(report_path: str, model: bool = False) -> list[str]:
    """The report's headline per reward model and policy: held-out accuracy, and the RM's score and distinct-2 (the
    demo's pipeline), or (model: pipelines/model.sh's) greedy and sampled accuracy with an example."""
    report = json.loads(Path(report_path).read_text())
    lines = [] if model else [f"  rm {d.rsplit('/', 1)[-1]}: held-out accuracy {m['overall']['accuracy']:.3f}"
                              for d, m in report["reward_models"].items()]
    for name, p in report["policies"].items():
        if model:  # the task's reward judged
            e = p["examples"][0]
            lines.append(f"  policy {name}: held-out accuracy greedy {p['task_accuracy_greedy']:.3f}, "
                         f"sampled {p['task_accuracy_sampled']:.3f}; e.g. {e['prompt']!r} -> {e['completion']!r}")
            continue
        acc = p["task_accuracy_sampled"]
        lines.append(f"  policy {name}: task accuracy (sampled) {'-' if acc is None else f'{acc:.3f}'}, "
                     f"RM score (sampled) {p['rm_score_sampled']:.3f}, distinct-2 {p['distinct_2']:.3f}")
        if p.get("tool_use"):
            t = p["tool_use"]
            lines.append(f"  policy {name}: arithmetic accuracy with the calculator {t['accuracy_with_tools']:.3f}, "
                         f"without {t['accuracy_without_tools']:.3f}; {t['tool_calls']:.2f} calls per completion, "
                         f"{t['tool_errors']:.3f} refused")
    return lines


def main(argv: list[str]) -> None:
    command, args = argv[0], argv[1:]
    if command == "stage_args":
        stage_args(args[0], args[1:])
    elif command == "max_new_tokens":
        print(max_new_tokens(args[0]))
    elif command == "summary":
        lines = summary(args[0], model="--model" in args[1:])
        if lines:
            print("\n".join(lines))
    else:
        sys.exit(f"kat_pipeline: unknown command {command!r} (stage_args, max_new_tokens, summary)")


if __name__ == "__main__":
    main(sys.argv[1:])
