"""A code task for a real instruct model: one-line Python functions, checked by running them (tasks/code_tests.py).

Each prompt asks for a function whose name carries its constant (`plus_7(x)`: x plus 7), and its row carries the
tests, comparisons with literals that are judged outside the sandbox (`assert plus_7(5) == 12`). Six kinds, each
with its constants (numbers, or letters for `count_e(s)`); held-out rows share no (kind, constant) with training
ones, and both are balanced across kinds. Nothing is downloaded;
all follows from the seed.

    python -m scripts.kat_task_data --task code_functions --out tasks/code
    python -m scripts.kat_train_grpo --policy <model> --prompts tasks/code/train.jsonl \
        --eval_prompts tasks/code/eval.jsonl --preset code_functions   # --env ...code_tests:CodeTests, 2 turns
"""
from __future__ import annotations

import random

from nanochat_ext.errors import InputError

ASK = ("Write a Python function `{name}` that {does}. Reply with the function in a ```python code block.")
# kind -> (name, what it does, the constants it takes, its body, three test inputs); {k} is the constant
KINDS = {
    "plus": ("plus_{k}(x)", "returns x plus {k}", range(1, 50), "x + {k}", ("0", "5", "-3")),
    "minus": ("minus_{k}(x)", "returns x minus {k}", range(1, 50), "x - {k}", ("0", "100", "-3")),
    "times": ("times_{k}(x)", "returns x times {k}", range(2, 30), "x * {k}", ("0", "3", "-2")),
    "repeat": ("repeat_{k}(s)", "returns the string s repeated {k} times", range(2, 30), "s * {k}",
               ("'ab'", "'x'", "''")),
    "first": ("first_{k}(s)", "returns the first {k} characters of the string s", range(1, 30), "s[:{k}]",
              ("'abcdefghijklmnopqrstuvwxyz0123456789'", "'python programming'", "'hi'")),
    "count": ("count_{k}(s)", "returns how many times the letter '{k}' occurs in the string s",
              "abcdefghijklmnopqrstuvwxyz", "s.count('{k}')", ("'{k}a{k}b'", "'{k}{k}{k}'", "'the cat'")),
}


def solution(kind: str, k, body_k=None) -> str:
    """The function for constant k (its body computing with body_k instead: a near miss)."""
    name, _, _, body, _ = KINDS[kind]
    return f"def {name.format(k=k)}:\n    return {body.format(k=k if body_k is None else body_k)}"


def tests(kind: str, k) -> str:
    """The row's tests: each input's right answer, as a literal the sandbox never sees."""
    name, _, _, body, inputs = KINDS[kind]
    function, argument = name.format(k=k).split("(")[0], name.split("(")[1].rstrip(")")
    lines = []
    for given in (i.format(k=k) for i in inputs):
        want = eval(body.format(k=k), {}, {argument: eval(given)})  # our own bodies and literals: never a model's
        lines.append(f"assert {function}({given}) == {want!r}")
    return "\n".join(lines)


def row(kind: str, k) -> dict:
    name, does, _, _, _ = KINDS[kind]
    prompt = ASK.format(name=name.format(k=k), does=does.format(k=k))
    return {"prompt": prompt, "tests": tests(kind, k), "kind": kind, "prefix_id": f"{kind}-{k}"}


def make_questions(n_train: int, n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, held out) rows {prompt, tests, kind, prefix_id}: the held-out (kind, constant) pairs, balanced across
    kinds, never occur in training; training draws the rest (with repeats where n_train asks for more)."""
    if n_train < 1 or n_eval < 0:
        raise InputError(f"--n_train must be >= 1 and --n_eval >= 0, got {n_train} and {n_eval}")
    rng = random.Random(seed)
    pool = {kind: list(spec[2]) for kind, spec in KINDS.items()}
    for constants in pool.values():
        rng.shuffle(constants)
    held_out, kinds = [], list(KINDS)
    for i in range(n_eval):
        kind = kinds[i % len(kinds)]
        if len(pool[kind]) <= len(KINDS[kind][2]) // 2:
            raise InputError(f"--n_eval {n_eval} would hold out over half of the {kind} functions: ask for fewer")
        held_out.append(row(kind, pool[kind].pop()))
    train = []
    for _ in range(n_train):  # kinds balanced, each kind's constants those left
        kind = rng.choice(kinds)
        train.append(row(kind, rng.choice(pool[kind])))
    return train, held_out


def make_pairs(rows: list[dict], seed: int) -> list[dict]:
    """The prompts as preference pairs: the right function chosen, one computing with the next constant (or
    letter) rejected."""
    rng, pairs = random.Random(seed), []
    for r in rows:
        kind, k = r["kind"], r["prefix_id"].split("-", 1)[1]
        k = int(k) if k.isdigit() else k
        near = k + rng.choice([-1, 1]) if isinstance(k, int) else chr((ord(k) - 96) % 26 + 97)  # the next letter
        pairs.append({"prompt": [{"role": "user", "content": r["prompt"]}],
                      "chosen": [{"role": "assistant", "content": f"```python\n{solution(kind, k)}\n```"}],
                      "rejected": [{"role": "assistant", "content": f"```python\n{solution(kind, k, near)}\n```"}]})
    return pairs
