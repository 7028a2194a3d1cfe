"""A verifiable task for a real instruct model: arithmetic asked in words, with the answer kept for the reward.

Four kinds of question (a sum, a difference, a product, a short word problem), each phrased several ways and ending
in "Answer with the number only.", so that `--reward_fn last_number` can score a reply by its last number. A small
instruct model (SmolLM2-135M-Instruct) answers about one in five right at the start, which leaves GRPO room to teach
it. Held-out questions share no (kind, operands) with the training ones. Nothing is downloaded; all follows from seed.
"""
from __future__ import annotations

import random

from nanochat_ext.errors import InputError

ASK = " Answer with the number only."
# kind -> (phrasings, operand ranges, the answer)
KINDS = {
    "sum": (["What is {a} plus {b}?", "Add {a} and {b}.", "What do you get when you add {a} to {b}?"],
            (10, 99), (10, 99), lambda a, b: a + b),
    "difference": (["What is {a} minus {b}?", "Subtract {b} from {a}.", "How much is {a} take away {b}?"],
                   (50, 99), (10, 49), lambda a, b: a - b),
    "product": (["What is {a} times {b}?", "Multiply {a} by {b}.", "What is the product of {a} and {b}?"],
                (2, 9), (2, 19), lambda a, b: a * b),
    "story": (["Sam has {a} apples and buys {b} more. How many apples does Sam have now?",
               "A shelf holds {a} books and {b} more are added. How many books are on the shelf?",
               "There are {a} birds on a tree and {b} more land on it. How many birds are on the tree?"],
              (10, 60), (10, 39), lambda a, b: a + b),
}


def make_questions(n_train: int, n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows), each {prompt, answer, kind}, the kinds in turn so that each split holds every kind
    in equal measure. Held-out questions are distinct, and no training question has a held-out (kind, a, b)."""
    fewest = min((a_hi - a_lo + 1) * (b_hi - b_lo + 1) for _, (a_lo, a_hi), (b_lo, b_hi), _ in KINDS.values())
    if -(-n_eval // len(KINDS)) > fewest // 2:  # held-out questions are distinct, and training needs the rest
        raise InputError(f"--n_eval {n_eval}: at most {fewest // 2 * len(KINDS)} held-out questions (each of the "
                         f"{len(KINDS)} kinds holds only {fewest} distinct ones, half kept for training)")
    rng = random.Random(seed)
    held_out: set[tuple[str, int, int]] = set()

    def draw(i: int) -> tuple[str, int, int]:
        kind = list(KINDS)[i % len(KINDS)]
        _, (a_lo, a_hi), (b_lo, b_hi), _ = KINDS[kind]
        return kind, rng.randint(a_lo, a_hi), rng.randint(b_lo, b_hi)

    def row(kind: str, a: int, b: int) -> dict:
        phrasings, _, _, answer = KINDS[kind]
        return {"prompt": rng.choice(phrasings).format(a=a, b=b) + ASK, "answer": str(answer(a, b)), "kind": kind}

    eval_rows = []
    while len(eval_rows) < n_eval:
        q = draw(len(eval_rows))
        if q not in held_out:
            held_out.add(q)
            eval_rows.append(row(*q))
    train_rows = []
    while len(train_rows) < n_train:
        q = draw(len(train_rows))
        if q not in held_out:
            train_rows.append(row(*q))
    return train_rows, eval_rows


def make_pairs(rows: list[dict], seed: int) -> list[dict]:
    """Preference pairs in the conversational format TRL and our readers share: each question, its right answer
    chosen and a near miss (off by 1 to 10) rejected, as a sentence, so a reward model must read the number."""
    rng = random.Random(seed)
    pairs = []
    for r in rows:
        right = int(r["answer"])
        wrong = right + rng.choice([-1, 1]) * rng.randint(1, 10)
        reply = rng.choice(["The answer is {}.", "{}", "It is {}."])
        pairs.append({"prompt": [{"role": "user", "content": r["prompt"]}],
                      "chosen": [{"role": "assistant", "content": reply.format(right)}],
                      "rejected": [{"role": "assistant", "content": reply.format(wrong)}]})
    return pairs
