"""A task a tool makes solvable: multiplying two 3-digit numbers, with a `multiply` tool (the example tool module of
docs/tools.md). A 135M model cannot multiply 347 by 829 in its head; with the tool it only has to call it and repeat
the result. `make_questions` writes the prompts (the answer kept for `--reward_fn last_number`), `make_demonstrations`
the conversations SFT first teaches the call format with, as transformers writes tool calls:

    {"messages": [{"role": "user", "content": "What is 347 times 829?"},
                  {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function":
                      {"name": "multiply", "arguments": {"a": 347, "b": 829}}}]},
                  {"role": "tool", "content": "287663"},
                  {"role": "assistant", "content": "347 times 829 is 287663."}]}

    python -m scripts.kat_train_grpo ... --tools nanochat_ext.tasks.multiplication:multiply --reward_fn last_number
"""
from __future__ import annotations

import random

from nanochat_ext.errors import InputError

ASK = ["What is {a} times {b}?", "Multiply {a} by {b}.", "What is the product of {a} and {b}?",
       "Compute {a} x {b}."]
LOW, HIGH = 100, 999


def multiply(a: int, b: int) -> int:
    """Multiply two integers exactly.

    Args:
        a: The first factor.
        b: The second factor.

    Returns:
        The product a * b.
    """
    return a * b


def _draw(rng: random.Random) -> tuple[int, int, str]:
    a, b = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)
    return a, b, rng.choice(ASK).format(a=a, b=b)


def make_questions(n_train: int, n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, held out) prompt rows {prompt, answer, kind, factors}; no held-out pair of factors occurs in
    training."""
    if n_train < 1 or n_eval < 0:
        raise InputError(f"--n_train must be >= 1 and --n_eval >= 0, got {n_train} and {n_eval}")
    rng, seen, rows = random.Random(seed), set(), []
    while len(rows) < n_train + n_eval:
        a, b, question = _draw(rng)
        if (a, b) not in seen:
            seen.add((a, b))
            rows.append({"prompt": question, "answer": str(a * b), "kind": "product", "factors": [a, b]})
    return rows[:n_train], rows[n_train:]


def make_demonstrations(rows: list[dict]) -> list[dict]:
    """A worked conversation per prompt row: the call, the tool's answer, the answer stated."""
    out = []
    for r in rows:
        a, b = r["factors"]
        call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
        out.append({"messages": [{"role": "user", "content": r["prompt"]},
                                 {"role": "assistant", "content": "", "tool_calls": [call]},
                                 {"role": "tool", "content": str(a * b)},
                                 {"role": "assistant", "content": f"{a} times {b} is {a * b}."}]})
    return out


def make_pairs(rows: list[dict], seed: int) -> list[dict]:
    """The questions as preference pairs: the right product chosen, one off in a digit rejected."""
    rng, pairs = random.Random(seed), []
    for r in rows:
        wrong = int(r["answer"]) + rng.choice([-1, 1]) * 10 ** rng.randint(0, 2)
        pairs.append({"prompt": [{"role": "user", "content": r["prompt"]}],
                      "chosen": [{"role": "assistant", "content": f"It is {r['answer']}."}],
                      "rejected": [{"role": "assistant", "content": f"It is {wrong}."}]})
    return pairs
