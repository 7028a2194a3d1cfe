"""training/loop.py's own rules, no model: when a `--X_every` action is due, what --save_every is where not given,
how --max_steps follows from --num_epochs, and the lr schedule the loop sets each step (its cadence end to end, with
every trainer: test_reliability.py, test_grpo.py, test_rm_train.py)."""
from __future__ import annotations

import pytest
import torch

from nanochat_ext.errors import InputError
from nanochat_ext.training.loop import (
    DEFAULT_MAX_STEPS,
    SAVE_EVERY_AT_LEAST,
    SAVE_EVERY_AT_MOST,
    LoopConfig,
    due,
    save_every,
)
from nanochat_ext.training.optim import lr_multiplier


def test_an_every_n_action_is_due_at_its_multiples_and_zero_means_only_the_end():
    assert [done for done in range(1, 13) if due(done, 4)] == [4, 8, 12]
    assert not any(due(done, 0) for done in range(1, 13))


def test_save_every_defaults_to_a_tenth_of_the_run_within_its_bounds():
    assert SAVE_EVERY_AT_LEAST == 25 and SAVE_EVERY_AT_MOST == 500  # docs/reliability.md#checkpoints says these
    assert [save_every(None, n) for n in (10, 250, 251, 1000, 7000, 100000)] == [25, 25, 26, 100, 500, 500]
    assert save_every(0, 1000) == 0 and save_every(7, 1000) == 7  # given: as given


def test_max_steps_follows_the_epochs_unless_given(capsys):
    assert LoopConfig().with_steps(1000, 8, "prompts").max_steps == DEFAULT_MAX_STEPS
    assert LoopConfig(num_epochs=2).with_steps(1000, 8, "prompts").max_steps == 1000 // 8 * 2
    assert LoopConfig(max_steps=7, num_epochs=2).with_steps(1000, 8, "prompts").max_steps == 7
    assert "--num_epochs 2 not used" in capsys.readouterr().out
    with pytest.raises(InputError, match="--num_epochs 1: 5 train pairs make no step of 8"):
        LoopConfig(num_epochs=1).with_steps(5, 8, "pairs")


@pytest.mark.parametrize("decay,end", [("cosine", 0.1), ("linear", 0.0)])
def test_the_schedule_warms_up_linearly_then_decays_to_its_end(decay, end):
    steps, warmup = 20, 4
    mult = torch.tensor([lr_multiplier(s, steps, warmup, decay=decay) for s in range(steps)])
    assert torch.all(mult[:warmup].diff() > 0) and mult[warmup - 1] <= 1.0
    assert mult[warmup] == pytest.approx(1.0) and torch.all(mult[warmup:].diff() <= 0)
    assert lr_multiplier(steps, steps, warmup, decay=decay) == pytest.approx(end, abs=1e-9)
