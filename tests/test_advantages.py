"""algorithms/advantages.py on its own: each estimator's advantages on ragged groups (GRPO's scaling by the group's
or the batch's spread, TRL's sample std; RLOO with the KL in the reward), a batch-wide spread over the groups in the
loss only, and what each estimator declares checked against the flags it meets. Against TRL's, OpenRLHF's and the
Tinker cookbook's own code: test_trl_oracle.py."""
from __future__ import annotations

import re

import pytest
import torch

from nanochat_ext.algorithms.advantages import ESTIMATORS, advantages, group_advantages
from nanochat_ext.algorithms.grpo import zero_advantage_groups
from nanochat_ext.algorithms.grpo_config import GRPOConfig
from nanochat_ext.algorithms.rollout_batch import RolloutBatch
from nanochat_ext.errors import InputError


@pytest.mark.parametrize("std_mode,unbiased", [("sample", True), ("population", False)])
def test_advantages(std_mode, unbiased):
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 2.0, 3.0])
    adv = group_advantages(rewards, 4, "group", std_mode)
    assert torch.equal(adv[:4], torch.zeros(4))  # a zero-std group: zero, not NaN (equal integers: exact)
    assert torch.isfinite(adv).all() and adv[4:].mean().abs() < 1e-6
    centred = torch.tensor([-1.5, -0.5, 0.5, 1.5])
    var = 5.0 / (3 if unbiased else 4)  # squared deviations 5.0 over n - 1 (sample, TRL) or n (population)
    torch.testing.assert_close(adv[4:], centred / (var ** 0.5 + 1e-4))
    torch.testing.assert_close(group_advantages(rewards, 4, "none", std_mode)[4:], centred)
    batch_std = rewards.std(unbiased=unbiased)
    torch.testing.assert_close(group_advantages(rewards, 4, "batch", std_mode)[4:], centred / (batch_std + 1e-4))


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_batch_scaling_counts_only_the_groups_in_the_loss(estimator):
    """A group left out of the loss (a reward the machine could not compute, errors.Unscored: its rewards set to 0)
    is not part of the batch's spread: the kept groups' advantages are those of the batch without it."""
    kept_rewards = torch.tensor([0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 2.0, 3.0])
    with_left_out = torch.cat([kept_rewards[:4], torch.zeros(4), kept_rewards[4:]])
    kept = torch.tensor([True] * 4 + [False] * 4 + [True] * 8)
    got = advantages(estimator, with_left_out, 4, "batch", kept=kept)
    torch.testing.assert_close(got[kept], advantages(estimator, kept_rewards, 4, "batch"))
    none_kept = advantages(estimator, torch.zeros(8), 4, "batch", kept=torch.zeros(8, dtype=torch.bool))
    assert torch.equal(none_kept, torch.zeros(8))  # a step whose every group is left out: no advantage, no NaN


def test_advantages_default_to_trls_sample_std():
    rewards = torch.tensor([0.0, 1.0])  # G=2: TRL's advantages are +-0.7071, population std would give +-1
    torch.testing.assert_close(group_advantages(rewards, 2, "group"), torch.tensor([-0.5, 0.5]) / (0.5 ** 0.5 + 1e-4))



def test_estimators_declare_what_they_are_and_flags_are_checked_from_it():
    """#80 items 4-5: RLOO with its defaults (TRL's RLOOTrainer: the KL in the reward, unscaled) keeps a group of
    equal task rewards at advantages of beta x its KL spread (<= 1e-2), where group scaling would blow them up to
    about 1; train/zero_std_groups counts the groups whose advantages are zero; combinations an estimator does not
    define are refused in one line, from what it declares."""
    g = torch.Generator().manual_seed(0)
    G, T = 4, 12
    mask = (torch.arange(T)[None, :] < torch.tensor([12, 9, 5, 11, 12, 3, 7, 10])[:, None]).float()  # ragged
    logp = -torch.rand(2 * G, T, generator=g)
    batch = RolloutBatch(engine_logp=logp, ref_logp=logp + 0.01 * torch.randn(2 * G, T, generator=g), mask=mask)
    rewards = torch.tensor([1.0] * G + [0.0, 1.0, 1.0, 0.0])  # a group of equal rewards, a group that splits
    cfg = GRPOConfig(advantage="rloo")
    assert cfg.scaling == "none" and GRPOConfig().scaling == "group"  # each its reference's default
    adv = advantages("rloo", rewards, G, cfg.scaling, batch=batch, kl_coef=cfg.beta)
    assert adv[:G].abs().max() <= 1e-2 and adv[G:].abs().max() > 0.5, adv
    blown = advantages("rloo", rewards, G, "group", batch=batch, kl_coef=cfg.beta)
    assert blown[:G].abs().max() > 0.5, blown  # what the refused combination would train on
    assert zero_advantage_groups(adv, mask, G) == 0  # the KL tells the equal group's members apart
    assert zero_advantage_groups(advantages("grpo", rewards, G, "group"), mask, G) == 1
    refused = {("rloo", "group", 0.04, False): "--scale_rewards group divides each group by its own spread",
               ("rloo", None, 0.04, True): "--filter_zero_std drops the groups whose rewards are all equal",
               ("reinforce_pp", None, 0.0, True): "OpenRLHF's reinforce: no baseline",
               ("reinforce_pp_baseline", None, 0.0, True): "whitened over the batch",
               ("reinforce_pp", "batch", 0.04, False): "--scale_rewards batch: --advantage reinforce_pp does not read",
               ("distill", None, 0.0, True): "the Tinker cookbook"}
    for (advantage, scale, beta, filter_zero_std), said in refused.items():
        with pytest.raises(InputError, match=re.escape(said)):
            GRPOConfig(advantage=advantage, scale_rewards=scale, beta=beta).check(filter_zero_std)
    for advantage, beta in (("grpo", 0.04), ("rloo", 0.0)):  # defined: equal rewards, zero advantages
        GRPOConfig(advantage=advantage, beta=beta).check(filter_zero_std=True)
        assert ESTIMATORS[advantage].zero_when_rewards_equal(beta)
