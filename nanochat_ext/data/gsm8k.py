"""GSM8K as nanochat's `tasks/gsm8k.py` (92d63d4) reads and scores it: a row {question, answer} of the
`openai/gsm8k` dataset is a user turn and a reply whose `<<expr=result>>` spans are calculator calls (a python
part, then its output part, which SFT does not train on); the answer is the number after `#### `, commas
removed, compared with the reference as a string (so `72.0`, or `72.` before a full stop, is not `72`).
"""
from __future__ import annotations

import re

GSM_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
TAG_RE = re.compile(r"(<<[^>]+>>)")


def is_gsm8k_row(obj: dict) -> bool:
    """A GSM8K dataset row: a question and its worked answer, and no prompt of our own format."""
    return "question" in obj and "answer" in obj and "prompt" not in obj and "messages" not in obj


def answer_parts(answer: str) -> list[dict]:
    """The worked answer as nanochat's reply parts: text, and for each `<<expr=result>>` a python part (expr) and
    a python_output part (result; split at the last `=`; a tag without one has an empty output)."""
    parts = []
    for piece in TAG_RE.split(answer):
        if piece.startswith("<<") and piece.endswith(">>"):
            expr, _, result = piece[2:-2].rpartition("=") if "=" in piece else (piece[2:-2], "", "")
            parts += [{"type": "python", "text": expr}, {"type": "python_output", "text": result}]
        else:
            parts.append({"type": "text", "text": piece})
    return parts


def extract_answer(text: str) -> str | None:
    """The number after the first `#### `, commas removed; None where there is none."""
    match = GSM_RE.search(text)
    return match.group(1).strip().replace(",", "") if match else None


def reference_answer(answer: str) -> str | None:
    """The reference: extract_answer of the worked answer's last text part (where nanochat reads it)."""
    return extract_answer(answer_parts(answer)[-1]["text"])
