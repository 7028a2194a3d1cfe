"""GRPO numerics against Hugging Face TRL's own code (tests/fixtures/trl-golden, written by
make_golden.py with TRL 1.16): the loss and its gradient for every TRL loss_type we alias x token /
sequence (GSPO) importance, on ragged completions with a masked one; group- and batch-scaled
advantages (TRL's sample std); log-probs at a sampling temperature; the correction of the sampling engine's
log-probs (TRL's vllm_importance_sampling_mode) and RLOO's advantages (lines_golden.pt, make_lines_golden.py); and
REINFORCE++'s advantages against OpenRLHF's own functions (tests/fixtures/openrlhf-golden); on-policy distillation's
against the Tinker cookbook's (tests/fixtures/tinker-golden)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nanochat_ext.algorithms.advantages import (
    advantages,
    distill_advantages,
    group_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    sequence_kl,
)
from nanochat_ext.algorithms.grpo import LossConfig, engine_weights, grpo_loss, loss_normaliser
from nanochat_ext.algorithms.grpo_config import TRL_LOSS_TYPES
from nanochat_ext.algorithms.rollout_batch import RolloutBatch
from nanochat_ext.training.logprobs import token_logprobs_chunked

GOLDEN = torch.load(Path(__file__).parent / "fixtures" / "trl-golden" / "golden.pt", weights_only=True)


@pytest.mark.parametrize("level", ["token", "sequence"])  # sequence_product: RLOOTrainer's (below)
@pytest.mark.parametrize("loss_type", list(TRL_LOSS_TYPES))
def test_loss_and_gradient_equal_trls(loss_type, level):
    g = GOLDEN
    mask, weights = g["mask"], torch.ones(g["mask"].size(0))
    assert mask.sum(1).unique().numel() > 3 and (mask.sum(1) == 0).any()  # ragged, one completion masked
    cfg = LossConfig(TRL_LOSS_TYPES[loss_type], clip_eps=0.2, clip_eps_high=0.28, beta=0.04,
                     max_new_tokens=mask.size(1), importance_level=level)
    logp = g["logp"].clone().requires_grad_(True)
    loss, _ = grpo_loss(logp, g["old_logp"], g["ref_logp"], g["advantages_group"], mask, weights, cfg,
                        loss_normaliser(mask, weights, cfg).item())
    loss.backward()
    want = g["loss"][f"{loss_type}/{level}"]
    torch.testing.assert_close(loss.detach(), want["loss"], atol=1e-6, rtol=0)
    torch.testing.assert_close(logp.grad, want["grad"], atol=1e-7, rtol=0)


@pytest.mark.parametrize("scale", ["group", "batch"])
def test_advantages_equal_trls(scale):
    got = group_advantages(GOLDEN["rewards"], GOLDEN["group_size"], scale)  # default std_mode: sample, as TRL
    torch.testing.assert_close(got, GOLDEN[f"advantages_{scale}"].float(), atol=1e-6, rtol=0)


def test_logprobs_at_a_temperature_equal_trls():
    logp, _ = token_logprobs_chunked(lambda x: x, GOLDEN["logits"], GOLDEN["index"], 4, temperature=0.7)
    torch.testing.assert_close(logp, GOLDEN["logp_t07"], atol=1e-6, rtol=1e-6)  # values near -25: fp32 ulp 2e-6


LINES = torch.load(Path(__file__).parent / "fixtures" / "trl-golden" / "lines_golden.pt", weights_only=True)


@pytest.mark.parametrize("key", list(LINES["weights"]))
def test_engine_correction_equals_trls_vllm_importance_sampling(key):
    """--engine_correction against TRL's vllm_importance_sampling_mode (its own lines, make_lines_golden.py): the
    weights of every mode and bounds (ratios past them both ways, per token and per completion, a fully masked
    completion), and the loss and gradient they give under TRL's dapo and grpo loss types."""
    mode, low, high = key.split("/")
    g, w = GOLDEN, LINES["weights"][key]
    cfg = LossConfig(engine_correction=mode, engine_clip_min=None if low == "None" else float(low),
                     engine_clip_max=float(high))
    got = engine_weights(g["old_logp"], LINES["sampling_logp"], g["mask"], cfg)
    torch.testing.assert_close(got, w, atol=1e-6, rtol=1e-6)
    for loss_type in ("dapo", "grpo"):
        cfg = LossConfig(TRL_LOSS_TYPES[loss_type], clip_eps=0.2, clip_eps_high=0.28, beta=0.04, engine_correction=mode,
                         engine_clip_min=None if low == "None" else float(low), engine_clip_max=float(high),
                         max_new_tokens=g["mask"].size(1))
        weights = torch.ones(g["mask"].size(0))
        logp = g["logp"].clone().requires_grad_(True)
        loss, _ = grpo_loss(logp, g["old_logp"], g["ref_logp"], g["advantages_group"], g["mask"], weights, cfg,
                            loss_normaliser(g["mask"], weights, cfg).item(), LINES["sampling_logp"])
        loss.backward()
        want = LINES["loss"][f"{key}/{loss_type}"]
        torch.testing.assert_close(loss.detach(), want["loss"], atol=1e-6, rtol=0)
        torch.testing.assert_close(logp.grad, want["grad"], atol=1e-7, rtol=0)


@pytest.mark.parametrize("normalize", [False, True])
def test_rloo_advantages_equal_trls(normalize):
    """--advantage rloo against TRL's RLOOTrainer's own lines (make_lines_golden.py): the leave-one-out baseline on
    ragged rewards with a zero-spread group, unscaled (--scale_rewards none, TRL's default) and normalised over the
    batch (--scale_rewards batch, TRL's normalize_advantages)."""
    g = LINES["rloo"]
    got = rloo_advantages(g["rewards"], g["group_size"], "batch" if normalize else "none")
    torch.testing.assert_close(got, g[f"normalize={normalize}"].float(), atol=1e-6, rtol=0)


def test_rloo_kl_in_the_reward_and_loss_equal_trls():
    """--advantage rloo --beta 0.05 against TRL's RLOOTrainer's own lines (make_lines_golden.py): each completion's
    reward less beta x its summed k1 KL (pi_old against the reference) before the leave-one-out baseline, and the KL
    it logs (train/kl); then --importance_level sequence_product --loss_agg sequence against its _compute_loss: one
    ratio per completion, the product of its tokens', clipped at 0.2 / 0.28, the mean over completions. Ragged
    completions, one fully masked: TRL's loss counts that one's -A (a constant: no gradient), ours 0."""
    g, want = GOLDEN, LINES["rloo_kl"]
    mask = g["mask"]
    batch = RolloutBatch(engine_logp=g["old_logp"], ref_logp=g["ref_logp"], mask=mask)
    got = advantages("rloo", want["rewards"], want["group_size"], "none", batch=batch, kl_coef=want["beta"])
    torch.testing.assert_close(got, want["advantages"].float(), atol=1e-6, rtol=0)
    assert float(sequence_kl(g["old_logp"], g["ref_logp"], mask, "k1").sum() / mask.sum()) == \
        pytest.approx(float(want["kl"]), rel=1e-6)
    cfg = LossConfig("sequence", clip_eps=0.2, clip_eps_high=0.28, importance_level="sequence_product")
    weights = torch.ones(mask.size(0))
    logp = g["logp"].clone().requires_grad_(True)
    loss, _ = grpo_loss(logp, g["old_logp"], None, got, mask, weights, cfg, loss_normaliser(mask, weights, cfg).item())
    loss.backward()
    want = LINES["rloo_loss"]
    masked = mask.sum(1) == 0
    torch.testing.assert_close(loss.detach() - got[masked].sum() / mask.size(0), want["loss"], atol=1e-6, rtol=0)
    torch.testing.assert_close(logp.grad, want["grad"], atol=1e-7, rtol=0)


OPENRLHF = torch.load(Path(__file__).parent / "fixtures" / "openrlhf-golden" / "golden.pt", weights_only=True)


@pytest.mark.parametrize("key", list(OPENRLHF["advantages"]))
def test_reinforce_pp_advantages_equal_openrlhfs(key):
    """--advantage reinforce_pp and reinforce_pp_baseline against OpenRLHF's compute_advantages_and_returns run as
    written (make_golden.py there): per-token returns of the reward at each completion's last scored token and the
    KL penalty (k1, k2) from pi_old's and the reference's log-probs, whitened over the batch's scored tokens; ragged
    completions, one fully masked, one with a forced token inside."""
    estimator, kl_estimator = key.split("/")
    g = OPENRLHF
    got = reinforce_pp_advantages(g["rewards"], g["group_size"], g["old_logp"], g["ref_logp"], g["mask"].float(),
                                  g["kl_coef"], kl_estimator, baseline=estimator == "reinforce_baseline")
    torch.testing.assert_close(got, OPENRLHF["advantages"][key].float(), atol=1e-6, rtol=0)


TINKER = torch.load(Path(__file__).parent / "fixtures" / "tinker-golden" / "golden.pt", weights_only=True)


@pytest.mark.parametrize("key", list(TINKER["advantages"]))
def test_distillation_advantages_equal_the_tinker_cookbooks(key):
    """--advantage distill against the Tinker cookbook's incorporate_kl_penalty and compute_advantages run as written
    (make_golden.py there): the group-centred reward plus minus coef x the reverse KL of each sampled token (student
    minus teacher log-prob), discounted over the later tokens or not; compared on the scored tokens (ragged, one
    completion fully masked, one with a forced token inside), with the cookbook's teacher_kl as train/teacher_kl
    computes it."""
    coef, discount = map(float, key.split("/"))
    g = TINKER
    mask = g["mask"]
    assert mask.sum(1).unique().numel() > 3 and (mask.sum(1) == 0).any() and g["rewards"][3:6].unique().numel() == 1
    got = distill_advantages(g["rewards"], g["group_size"], g["student_logp"], g["teacher_logp"], mask.float(), coef,
                             discount)
    torch.testing.assert_close(got[mask], g["advantages"][key][mask].float(), atol=1e-6, rtol=0)
    reverse_kl = ((g["student_logp"].double() - g["teacher_logp"]) * mask).sum() / mask.sum()
    assert float(reverse_kl) == pytest.approx(g["teacher_kl"], rel=1e-6)
