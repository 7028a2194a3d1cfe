"""A verifiable task for a real instruct model: arithmetic asked in words, with the answer kept for the reward.

Four kinds of question (a sum, a difference, a product, a short word problem), each phrased several ways and ending
in "Answer with the number only.", so that `--reward_fn last_number` can score a reply by its last number. A small
instruct model (SmolLM2-135M-Instruct) answers about one in five right at the start, which leaves GRPO room to teach
it. Held-out questions share no (kind, operands) with the training ones. Nothing is downloaded; all follows from seed.

The density experiment's set (`make_skewed_questions`, `make_skewed_pairs`) skews the training kinds as the demo skews
its topics (SKEW: two dense kinds, two rare), keeps the held-out questions balanced across kinds, and records each
kind's training share on every row ("share"), which is what tells dense kinds from rare ones in the report. Its GRPO
form (`make_gap_questions`, GAP_SKEW) makes rare the kinds the model is behind on.
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
# kind -> share of the density experiment's training questions: two dense kinds, two rare ones (the demo's rare topics
# hold 3-5% of its prompts each)
SKEW = {"sum": 0.45, "difference": 0.45, "product": 0.05, "story": 0.05}
# The GRPO form's skew (docs/density.md, "Result 5"), fixed from a pilot before any weighted arm ran: rare are the two
# kinds SmolLM2-135M-Instruct answers worst before training (greedy: sums 1 in 16, differences 0) and that uniform GRPO
# on a balanced set raises (to 11 and 4 in 16); dense the two it knows best (products 4, word problems 2 in 16).
GAP_SKEW = {"sum": 0.05, "difference": 0.05, "product": 0.45, "story": 0.45}
UNITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
         "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


def make_questions(n_train: int, n_eval: int, seed: int,
                   shares: dict[str, float] | None = None) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows), each {prompt, answer, kind}, the kinds in turn so that each split holds every kind
    in equal measure; with `shares`, the training kinds in those shares (exact counts, shuffled) and every row marked
    with its kind's share. Held-out questions are distinct, and no training question has a held-out (kind, a, b)."""
    fewest = min((a_hi - a_lo + 1) * (b_hi - b_lo + 1) for _, (a_lo, a_hi), (b_lo, b_hi), _ in KINDS.values())
    if -(-n_eval // len(KINDS)) > fewest // 2:  # held-out questions are distinct, and training needs the rest
        raise InputError(f"--n_eval {n_eval}: at most {fewest // 2 * len(KINDS)} held-out questions (each of the "
                         f"{len(KINDS)} kinds holds only {fewest} distinct ones, half kept for training)")
    rng = random.Random(seed)
    held_out: set[tuple[str, int, int]] = set()
    train_kinds = kinds_in_shares(n_train, shares, rng) if shares else None

    def draw(i: int, kinds: list[str] | None = None) -> tuple[str, int, int]:
        kind = kinds[i] if kinds else list(KINDS)[i % len(KINDS)]
        _, (a_lo, a_hi), (b_lo, b_hi), _ = KINDS[kind]
        return kind, rng.randint(a_lo, a_hi), rng.randint(b_lo, b_hi)

    def row(kind: str, a: int, b: int) -> dict:
        phrasings, _, _, answer = KINDS[kind]
        share = {"share": shares[kind]} if shares else {}
        return {"prompt": rng.choice(phrasings).format(a=a, b=b) + ASK, "answer": str(answer(a, b)), "kind": kind,
                **share}

    eval_rows = []
    while len(eval_rows) < n_eval:
        q = draw(len(eval_rows))
        if q not in held_out:
            held_out.add(q)
            eval_rows.append(row(*q))
    train_rows = []
    while len(train_rows) < n_train:
        q = draw(len(train_rows), train_kinds)
        if q not in held_out:
            train_rows.append(row(*q))
    return train_rows, eval_rows


def kinds_in_shares(n: int, shares: dict[str, float], rng: random.Random) -> list[str]:
    """n kinds, each kind's count its share of n (largest remainders round), in a random order."""
    exact = {k: n * s / sum(shares.values()) for k, s in shares.items()}
    counts = {k: int(x) for k, x in exact.items()}
    for k in sorted(exact, key=lambda k: counts[k] - exact[k])[:n - sum(counts.values())]:
        counts[k] += 1
    kinds = [k for k, c in counts.items() for _ in range(c)]
    rng.shuffle(kinds)
    return kinds


def in_words(n: int) -> str:
    """An integer below 1000 in English words: forty-two, one hundred and five, minus three."""
    if n < 0:
        return "minus " + in_words(-n)
    if n >= 100:
        rest = n % 100
        return UNITS[n // 100] + " hundred" + (" and " + in_words(rest) if rest else "")
    return UNITS[n] if n < 20 else TENS[n // 10] + ("-" + UNITS[n % 10] if n % 10 else "")


def make_pairs(rows: list[dict], seed: int, wrong_format: float = 0.0) -> list[dict]:
    """Preference pairs in the conversational format TRL and our readers share: each question, its right answer
    chosen, and rejected a near miss (off by 1 to 10) as a sentence, so a reward model must read the number, or with
    probability `wrong_format` the right answer in words where the question asks for the number only. Each pair
    keeps its question's kind (and share)."""
    rng = random.Random(seed)
    pairs = []
    for r in rows:
        right = int(r["answer"])
        wrong = right + rng.choice([-1, 1]) * rng.randint(1, 10)
        reply = rng.choice(["The answer is {}.", "{}", "It is {}."])
        # drawn only when asked for: the plain pairs stay what they were for every seed
        rejected = reply.format(in_words(right) if wrong_format and rng.random() < wrong_format else wrong)
        pairs.append({"prompt": [{"role": "user", "content": r["prompt"]}],
                      "chosen": [{"role": "assistant", "content": reply.format(right)}],
                      "rejected": [{"role": "assistant", "content": rejected}],
                      **{k: r[k] for k in ("kind", "share") if k in r}})
    return pairs


def make_skewed_questions(n_train: int, n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """The density experiment's questions: training kinds in SKEW's shares, held-out ones balanced."""
    return make_questions(n_train, n_eval, seed, shares=SKEW)


def make_gap_questions(n_train: int, n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """The GRPO form's questions: training kinds in GAP_SKEW's shares (the kinds the model is behind on rare),
    held-out ones balanced."""
    return make_questions(n_train, n_eval, seed, shares=GAP_SKEW)


def make_skewed_pairs(rows: list[dict], seed: int) -> list[dict]:
    """The density experiment's pairs: a near miss or (a quarter of them) the wrong format rejected."""
    return make_pairs(rows, seed, wrong_format=0.25)
