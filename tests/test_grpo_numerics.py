"""GRPO / RM numerics against their definitions (TRL, DeepSeekMath, DAPO, Dr. GRPO, GSPO)."""
from __future__ import annotations

import pytest
import torch

from nanochat_ext.backbone import load_backbone
from nanochat_ext.grpo import CompletionLogprobs, LossConfig, loss_normaliser, make_sequences
from nanochat_ext.sampling import SamplingConfig, sample_token


def test_logprobs_are_taken_at_the_sampling_temperature(assets):
    """Completions sampled from softmax(logits / T) are scored under that distribution (TRL divides by T)."""
    bb = load_backbone(assets["gpt_modern"])
    batch = make_sequences([[5, 17, 42]], [[7, 8, 9, 10]], 1, 0)
    with torch.no_grad():
        logits = bb(batch["input_ids"])[0, 2:6]  # positions that predict the completion's tokens
        for T in (0.7, 1.0, 1.6):
            logp, entropy = CompletionLogprobs(bb, temperature=T)(batch["input_ids"], batch["gather"], batch["target"])
            want = torch.log_softmax(logits / T, -1)
            torch.testing.assert_close(logp[0], want.gather(-1, batch["target"][0, :, None])[:, 0])
            torch.testing.assert_close(entropy[0], -(want.exp() * want).sum(-1))
    with pytest.raises(ValueError, match="temperature > 0"):
        CompletionLogprobs(bb, temperature=0.0)


def test_a_uniform_of_zero_never_picks_a_removed_token():
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]])
    for u in (0.0, 1e-12, 0.5, 1 - 1e-7):
        token = int(sample_token(logits, torch.tensor([u]), SamplingConfig(temperature=1.0, top_k=2)))
        assert token in (1, 3), (u, token)
    # top-p that keeps tokens 1 and 3 only
    token = int(sample_token(logits, torch.tensor([0.0]), SamplingConfig(temperature=1.0, top_p=0.95)))
    assert token in (1, 3)


@pytest.mark.parametrize("agg", ["sequence", "dr_grpo"])
def test_masked_completions_keep_their_place_in_the_denominator(agg):
    """--mask_truncated zeroes a completion's tokens; per-completion normalisers still count it (TRL),
    so dr_grpo's normaliser is the constant completions x max_new_tokens."""
    mask = torch.ones(4, 5)
    mask[1] = 0.0  # a truncated completion, masked
    weights = torch.tensor([1.0, 2.0, 1.0, 0.5])
    cfg = LossConfig(loss_agg=agg, max_new_tokens=5)
    expected = weights.sum().item() * (5 if agg == "dr_grpo" else 1)
    assert loss_normaliser(mask, weights, cfg).item() == expected


def test_a_long_pair_keeps_the_same_prompt_window_on_both_sides_or_is_dropped(assets, tmp_path):
    from nanochat_ext import synthetic
    from nanochat_ext.data import load_pairs, tokenize_pairs
    from nanochat_ext.tokenizer import TokenizerWrapper

    tok = TokenizerWrapper.load(assets["tokenizer"])
    long_prompt = " ".join(f"question part {i}" for i in range(30))
    rows = [{"prompt": long_prompt, "chosen": "Yes.", "rejected": " ".join(["no"] * 60)},
            {"prompt": "hi", "chosen": "hello", "rejected": "bye"}]
    synthetic.write_jsonl(tmp_path / "pairs.jsonl", rows)
    pairs = load_pairs(tmp_path / "pairs.jsonl")[0]
    cut, n_long = tokenize_pairs(pairs, tok, 64, "truncate")
    assert n_long == 1 and len(cut) == 2
    chosen_resp, rejected_resp = tok.render_response("Yes."), tok.render_response(" ".join(["no"] * 60))
    prompt_c = cut[0].chosen[:len(cut[0].chosen) - len(chosen_resp)]
    assert cut[0].chosen == prompt_c + chosen_resp  # the short response is whole
    assert cut[0].rejected[:len(prompt_c)] == prompt_c  # ... and both sides saw the same prompt window
    assert len(cut[0].rejected) == 64 and cut[0].rejected[len(prompt_c):] == rejected_resp[:64 - len(prompt_c)]
    assert prompt_c[0] == tok.bos_id and len(prompt_c) >= 32  # the prompt keeps BOS and half the budget
    kept, n_long = tokenize_pairs(pairs, tok, 64, "drop")
    assert n_long == 1 and len(kept) == 1 and kept[0].chosen == cut[1].chosen
