"""Rule-based rewards for --reward_fn, each f(prompt, completion, row) -> float, where row is the
prompt's JSON object (e.g. with an "answer" field). Write your own with the same signature. The built-in ones
can be named alone (`--reward_fn gsm8k`); each needs a reference, the row's REFERENCE field, and scores 0 without
one (reference_problem says what is missing, so that a run refuses such rows before it starts)."""
from __future__ import annotations

import math
import re

from nanochat_ext.data.gsm8k import extract_answer, reference_answer

BUILT_IN = ("exact_match", "contains_answer", "last_number", "gsm8k", "gsm8k_numeric")  # --reward_fn NAME
REFERENCE = "answer"  # the row's field every built-in compares with
_WORD = re.compile(r"[\w+\-.]+")
# a number: thousands grouped by commas (1,024) or not, a sign only where no digit precedes it ("63-59" ends in 59)
_NUMBER = re.compile(r"(?<!\d)-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def _first_word(text: str) -> str:
    m = _WORD.search(text)
    return m.group(0).rstrip(".,") if m else ""


def exact_match(prompt: str, completion: str, row: dict) -> float:
    """1 if the completion's first word equals the row's answer (case-insensitive), else 0 (and 0 without an answer:
    an empty one would equal a completion without a word)."""
    answer = str(row.get(REFERENCE, "")).strip().lower()
    return float(bool(answer) and _first_word(completion).lower() == answer)


def contains_answer(prompt: str, completion: str, row: dict) -> float:
    """1 if the row's answer appears anywhere in the completion as a whole word, else 0."""
    answer = str(row.get(REFERENCE, "")).strip()
    return float(bool(answer) and re.search(rf"(?<!\w){re.escape(answer)}(?!\w)", completion) is not None)


def last_number(prompt: str, completion: str, row: dict) -> float:
    """1 if the last number in the completion equals the row's answer by value (`81`, `81.0`, `1,024` and "is 81."
    count), else 0: the check of a reply told to answer with the number only, which small instruct models still
    wrap in words."""
    found = _NUMBER.findall(completion)
    try:
        return float(bool(found) and abs(float(found[-1].replace(",", "")) - float(str(row.get(REFERENCE, "")))) < 1e-9)
    except ValueError:  # a reference that is no number never matches
        return 0.0


def gsm8k(prompt: str, completion: str, row: dict) -> float:
    """nanochat's GSM8K reward: 1 if the completion's answer (after `#### `) is the reference's, as strings; 0 where
    the reference has none (nanochat's rule would count a completion without one as a match)."""
    want = reference_answer(str(row.get(REFERENCE, "")))
    return float(want is not None and extract_answer(completion) == want)


def gsm8k_numeric(prompt: str, completion: str, row: dict) -> float:
    """GSM8K scored by value rather than by string: `72.0` and `72.` count as 72 (not nanochat's rule)."""
    got, want = extract_answer(completion), reference_answer(str(row.get(REFERENCE, "")))
    try:
        return float(got is not None and want is not None and abs(float(got) - float(want)) < 1e-9)
    except ValueError:  # `1.2.3` matches the pattern but is no number
        return 0.0


def reference_problem(name: str, row: dict) -> str | None:
    """Why the built-in reward `name` cannot score completions of this row (its reference, row[REFERENCE], is missing
    or holds no answer it can read), or None when it can."""
    answer = row.get(REFERENCE)
    if answer is None or not str(answer).strip():
        return f"missing or empty: --reward_fn {name} compares each completion with it"
    if name == "last_number":
        try:
            finite = math.isfinite(float(str(answer)))
        except ValueError:
            finite = False
        if not finite:
            return f"{answer!r} is not a number, which --reward_fn {name} compares by value"
    if name in ("gsm8k", "gsm8k_numeric"):
        want = reference_answer(str(answer))
        if want is None:
            return (f"has no '#### <number>' line, where --reward_fn {name} reads the reference answer (GSM8K's "
                    f"worked answers end with one)")
        if name == "gsm8k_numeric":
            try:
                float(want)
            except ValueError:
                return f"its '#### ' answer {want!r} is not a number, which --reward_fn {name} compares by value"
    return None
