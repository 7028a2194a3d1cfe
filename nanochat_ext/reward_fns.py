"""Rule-based rewards for --reward_fn, each f(prompt, completion, row) -> float, where row is the
prompt's JSON object (e.g. with an "answer" field). Write your own with the same signature."""
from __future__ import annotations

import re

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
