"""Rule-based rewards the GRPO tests pass as --reward_fn rewards_for_tests:<name>."""
import math

from nanochat_ext.errors import Unscored
from nanochat_ext.tasks.code_tests import run_tests


def vowel_share(prompt, completion, row):
    """Dense and learnable from scratch: the share of vowels among the completion's letters."""
    letters = [c for c in completion.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / max(len(letters), 1)


def echoes(prompt, completion, row):
    """Reads all three of its inputs, each in a way that orders a group's completions: the completion's vowel share,
    plus the shares of its letters found in the prompt and in the row's topic. Prompts or rows misordered, taken
    from another rank or left empty change the rewards, and the advantages with them."""
    letters = [c for c in completion.lower() if c.isalpha()]
    n = max(len(letters), 1)
    return (vowel_share(prompt, completion, row) + sum(c in prompt.lower() for c in letters) / n
            + 2 * sum(c in row["topic"] for c in letters) / n)


def text_length(prompt, completion, row):
    """The completion's length in characters: what text a reward function was given, in a number."""
    return float(len(completion))


def not_a_number(prompt, completion, row):
    return math.nan


def flat_for_even_prompts(prompt, completion, row):
    """Zero spread for about half the prompts (a constant), vowel_share for the rest: DAPO's dynamic
    sampling has groups to drop."""
    return 0.0 if len(prompt) % 2 == 0 else vowel_share(prompt, completion, row)


def raises_runtime_error(prompt, completion, row):
    raise RuntimeError("the grader's service is down")


def returns_bool(prompt, completion, row):
    return True


def returns_str(prompt, completion, row):
    return "0.75"


def returns_huge(prompt, completion, row):
    return 1e300


def zero(prompt, completion, row):
    """Every completion 0: every group has zero spread, so every advantage is 0."""
    return 0.0


def echoes_batched(prompts, completions, rows):
    """echoes over a step's lists at once (a batched reward function)."""
    return [echoes(p, c, r) for p, c, r in zip(prompts, completions, rows)]


echoes_batched.batched = True


def batched_short(prompts, completions, rows):
    """A batched function that loses a value."""
    return [0.0] * (len(completions) - 1)


batched_short.batched = True


def unscored_for_even_prompts(prompt, completion, row):
    """vowel_share, but the machine 'fails' to score every completion of a prompt of even length (errors.Unscored,
    as a sandbox that failed to start twice): those groups are left out of the loss."""
    if len(prompt) % 2 == 0:
        raise Unscored("the sandbox failed to start twice (a test's stand-in)")
    return vowel_share(prompt, completion, row)


def rows_code_passes(prompt, completion, row):
    """The row's own code, a stand-in for what a policy wrote (hostile or a solution), run sealed against the row's
    tests with a limit of 1 s: 1 if it passes."""
    return float(run_tests(row["code"], row["tests"], time_limit=1.0)[0])
