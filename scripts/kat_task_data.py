"""A verifiable task's prompts for a real instruct model (MODEL=smollm2 bash speedrun.sh): questions with answers,
split into training and held-out rows, scored by a built-in --reward_fn (code_functions: by running the model's
code against the row's tests, --env nanochat_ext.tasks.code_tests:CodeTests).

    <out>/train.jsonl, <out>/eval.jsonl   {prompt, answer, kind}; held-out (kind, operands) never occur in training
                                          (word_arithmetic_skewed and _gap: also the kind's share of training, "share";
                                          code_functions: {prompt, tests, kind})
    <out>/pairs.jsonl                     the training questions as preference pairs (the right answer chosen, a
                                          near miss rejected), for a reward model or bench/bench_real_model.sh
    <out>/sft.jsonl                       for a task a tool solves (multiplication): worked tool-call conversations
                                          that teach the call format first

    python -m scripts.kat_task_data [--task word_arithmetic|word_arithmetic_skewed|word_arithmetic_gap|multiplication|
                                            code_functions]
                                    [--n_train 2000] [--n_eval 64] [--seed 0]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from nanochat_ext.cli import parse, parser
from nanochat_ext.errors import EXIT_BAD_INPUT, InputError
from nanochat_ext.runtime.checkpoint import base_dir
from nanochat_ext.runtime.session import say
from nanochat_ext.tasks import code_functions, multiplication, word_arithmetic
from nanochat_ext.tasks.synthetic import write_jsonl
from scripts.flags import add_flag

COMPLETE = ".complete"
# task -> (its questions' maker, its pairs' maker, the flags that score them)
TASKS = {"word_arithmetic": (word_arithmetic.make_questions, word_arithmetic.make_pairs, "--reward_fn last_number"),
         # the density experiment's (EXPERIMENT=density MODEL=smollm2): training kinds skewed, held-out ones balanced
         "word_arithmetic_skewed": (word_arithmetic.make_skewed_questions, word_arithmetic.make_skewed_pairs,
                                    "--reward_fn last_number"),
         # its GRPO form: rare the kinds the model is behind on (docs/density.md, "Result 5")
         "word_arithmetic_gap": (word_arithmetic.make_gap_questions, word_arithmetic.make_skewed_pairs,
                                 "--reward_fn last_number"),
         "multiplication": (multiplication.make_questions, multiplication.make_pairs, "--reward_fn last_number"),
         "code_functions": (code_functions.make_questions, code_functions.make_pairs,
                            "--env nanochat_ext.tasks.code_tests:CodeTests (in one turn: --reward_fn "
                            "nanochat_ext.tasks.code_tests:passes)")}
# task -> (the maker of its SFT demonstrations, written to <out>/sft.jsonl from the first training rows, its --tools)
DEMONSTRATIONS = {"multiplication": (multiplication.make_demonstrations, "nanochat_ext.tasks.multiplication:multiply")}


def flags() -> argparse.ArgumentParser:
    p = parser("kat_task_data", __doc__)
    p.add_argument("--task", choices=list(TASKS), default="word_arithmetic", help="which task (default: %(default)s)")
    add_flag(p, "kat_task_data", "out")
    p.add_argument("--n_train", type=int, default=2000, help="training prompts (default: %(default)s)")
    add_flag(p, "kat_task_data", "n_eval")
    add_flag(p, "kat_task_data", "n_sft")
    add_flag(p, "kat_task_data", "seed")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse(flags(), argv)
    out = Path(args.out) if args.out else base_dir() / "tasks" / args.task
    make, make_pairs, scored_by = TASKS[args.task]
    for flag, value, least in (("n_train", args.n_train, 1), ("n_eval", args.n_eval, 0), ("n_sft", args.n_sft, 0)):
        if value < least:  # before anything is written
            say(f"error: --{flag} must be >= {least}, got {value}")
            return EXIT_BAD_INPUT
    try:
        train, held_out = make(args.n_train, args.n_eval, args.seed)
    except InputError as e:
        say(f"error: {e}")
        return EXIT_BAD_INPUT
    (out / COMPLETE).unlink(missing_ok=True)
    write_jsonl(out / "eval.jsonl", held_out)
    write_jsonl(out / "pairs.jsonl", make_pairs(train, args.seed + 1))
    write_jsonl(out / "train.jsonl", train)
    tools = ""
    if args.task in DEMONSTRATIONS:
        make_demonstrations, tool = DEMONSTRATIONS[args.task]
        write_jsonl(out / "sft.jsonl", make_demonstrations(train[:args.n_sft]))
        tools = f"; {min(args.n_sft, len(train))} SFT demonstrations in sft.jsonl; --tools {tool}"
    (out / COMPLETE).touch()  # last: speedrun.sh's mark that the files are whole
    print(f"task: {args.task}, {len(train)} train / {len(held_out)} held-out prompts in {out}; {scored_by}{tools}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
