"""A guessing game: the example multi-turn environment (docs/tools.md). The policy guesses a secret number; the
environment answers each guess with "higher" or "lower", and the game ends when the guess is right (or after
--max_turns guesses). Its reward is 1 / (guesses taken) for a win, 0 otherwise.

    python -m scripts.kat_train_grpo --policy ... --prompts guesses.jsonl \
        --env nanochat_ext.tasks.guessing_game:GuessingGame --max_turns 6

Each prompt row carries its secret as "answer" (`make_prompts` writes such rows). The environment is made per
rollout from that row, so every rank plays the same game for the same prompt.
"""
from __future__ import annotations

import random
import re


class GuessingGame:
    """One rollout's game. The last integer of an assistant turn is its guess."""

    def __init__(self, row: dict):
        self.secret = int(row["answer"])
        self.guesses = 0
        self.won = False

    def step(self, reply: str) -> str | None:
        """The next user turn after this reply ("higher", "lower", or a reminder to guess), or None: won."""
        numbers = re.findall(r"-?\d+", reply)
        if not numbers:
            return "Guess a number."
        self.guesses += 1
        guess = int(numbers[-1])
        if guess == self.secret:
            self.won = True
            return None
        return "higher" if guess < self.secret else "lower"

    def get_reward(self) -> float:
        return 1.0 / self.guesses if self.won else 0.0


def make_prompts(n: int, seed: int = 0, low: int = 1, high: int = 100) -> list[dict]:
    """n prompts, each with its secret number drawn from [low, high] (the seed decides)."""
    rng = random.Random(seed)
    ask = f"I am thinking of a number from {low} to {high}. Guess it; I will say higher or lower."
    return [{"prompt": ask, "answer": rng.randint(low, high), "prefix_id": f"guess-{i}"} for i in range(n)]
