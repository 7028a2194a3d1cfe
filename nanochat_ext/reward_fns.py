"""Rule-based rewards for --reward_fn, each f(prompt, completion, row) -> float, where row is the
prompt's JSON object (e.g. with an "answer" field). Write your own with the same signature. The built-in ones
can be named alone (`--reward_fn gsm8k`)."""
from __future__ import annotations

import re

from nanochat_ext.gsm8k import extract_answer, reference_answer

BUILT_IN = ("exact_match", "contains_answer", "gsm8k", "gsm8k_numeric")  # --reward_fn NAME
_WORD = re.compile(r"[\w+\-.]+")


def _first_word(text: str) -> str:
    m = _WORD.search(text)
    return m.group(0).rstrip(".,") if m else ""


def exact_match(prompt: str, completion: str, row: dict) -> float:
    """1 if the completion's first word equals the row's answer (case-insensitive), else 0."""
    return float(_first_word(completion).lower() == str(row.get("answer", "")).strip().lower())


def contains_answer(prompt: str, completion: str, row: dict) -> float:
    """1 if the row's answer appears anywhere in the completion as a whole word, else 0."""
    answer = str(row.get("answer", "")).strip()
    return float(bool(answer) and re.search(rf"(?<!\w){re.escape(answer)}(?!\w)", completion) is not None)


def gsm8k(prompt: str, completion: str, row: dict) -> float:
    """nanochat's GSM8K reward: 1 if the completion's answer (after `#### `) is the reference's, as strings."""
    return float(extract_answer(completion) == reference_answer(str(row.get("answer", ""))))


def gsm8k_numeric(prompt: str, completion: str, row: dict) -> float:
    """GSM8K scored by value rather than by string: `72.0` and `72.` count as 72 (not nanochat's rule)."""
    got, want = extract_answer(completion), reference_answer(str(row.get("answer", "")))
    try:
        return float(got is not None and want is not None and abs(float(got) - float(want)) < 1e-9)
    except ValueError:  # `1.2.3` matches the pattern but is no number
        return 0.0
