"""Rule-based rewards the GRPO tests pass as --reward_fn rewards_for_tests:<name>."""
import math


def vowel_share(prompt, completion, row):
    """Dense and learnable from scratch: the share of vowels among the completion's letters."""
    letters = [c for c in completion.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / max(len(letters), 1)


def not_a_number(prompt, completion, row):
    return math.nan
