"""GRPO / RM numerics against their definitions (TRL, DeepSeekMath, DAPO, Dr. GRPO, GSPO)."""
from __future__ import annotations

import pytest
import torch

from nanochat_ext.algorithms.grpo import LOSS_STATS, LossConfig, loss_normaliser, policy_backward
from nanochat_ext.algorithms.rollout_batch import RolloutBatch
from nanochat_ext.algorithms.rollouts import Rollout, SignalFilter, in_global_order, zero_std_groups
from nanochat_ext.engine.sampling import SamplingConfig, sample_token
from nanochat_ext.models.attention import PrefixTree
from nanochat_ext.models.loader import load_backbone
from nanochat_ext.training.logprobs import CompletionLogprobs, make_sequences, token_logprobs


def test_logprobs_are_taken_at_the_sampling_temperature(assets):
    """Completions sampled from softmax(logits / T) are scored under that distribution (TRL divides by T)."""
    bb = load_backbone(assets["gpt_modern"])
    batch = make_sequences([[5, 17, 42]], [[7, 8, 9, 10]], 1, 0)
    with torch.no_grad():
        logits = bb(batch.input_ids)[0, 2:6]  # positions that predict the completion's tokens
        for T in (0.7, 1.0, 1.6):
            logp, entropy = CompletionLogprobs(bb, temperature=T)(batch.input_ids, batch.gather, batch.target)
            want = torch.log_softmax(logits / T, -1)
            torch.testing.assert_close(logp[0], want.gather(-1, batch.target[0, :, None])[:, 0])
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
    from nanochat_ext.data.batching import tokenize_pairs
    from nanochat_ext.data.rows import load_pairs
    from nanochat_ext.tasks import synthetic
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


def test_gspo_takes_one_clipped_ratio_per_completion():
    """Sequence level: every token of a completion carries exp(mean_t log ratio), and the clip keeps
    or drops a completion whole. Token level clips token by token."""
    from nanochat_ext.algorithms.grpo import grpo_loss

    logp = torch.zeros(2, 4, requires_grad=True)
    # completion 0: token ratios e^0.3, e^-0.3, e^0.3, e^-0.3 -> geometric mean 1; completion 1: all e^0.5
    old = -torch.tensor([[0.3, -0.3, 0.3, -0.3], [0.5, 0.5, 0.5, 0.5]])
    mask, adv, w = torch.ones(2, 4), torch.tensor([1.0, 1.0]), torch.ones(2)
    token_cfg = LossConfig(loss_agg="token", clip_eps=0.2)
    seq_cfg = LossConfig(loss_agg="token", clip_eps=0.2, importance_level="sequence")
    _, token_stats = grpo_loss(logp, old, None, adv, mask, w, token_cfg, 8.0)
    assert token_stats[1] == 6  # tokens 0, 2 of completion 0 and all of completion 1 are past 1.2
    loss, seq_stats = grpo_loss(logp, old, None, adv, mask, w, seq_cfg, 8.0)
    assert seq_stats[1] == 4  # completion 0's ratio is 1: kept whole; completion 1's is e^0.5: clipped whole
    loss.backward()
    # Completion 0's 4 tokens each carry s_0 = exp(mean log ratio) = 1: loss -4 s_0 / 8, and ds_0/dlogp_t = 1/4,
    # so -1/8 on each token; completion 1 is clipped whole: no gradient.
    torch.testing.assert_close(logp.grad, torch.tensor([[-1 / 8] * 4, [0.0] * 4]))
    # Unclipped, the sequence ratio is the geometric mean of the token ratios.
    loss, _ = grpo_loss(logp.detach(), old, None, adv, mask, w, LossConfig(clip_eps=10.0, importance_level="sequence"),
                        1.0)
    assert loss.item() == pytest.approx(-(4 * 1.0 + 4 * float(torch.exp(torch.tensor(0.5)))))


@pytest.mark.parametrize("agg", ["token", "sequence"])
def test_pg_objective_is_chat_rls_printed_loss_normalised_as_ours(assets, agg):
    """train/pg_objective = -sum(A logp) / N, N our loss's normaliser, aggregated as our loss (two micro-batches, a
    masked token, unequal weights); on-policy our loss is -sum(A) / N (the ratio is 1), another number."""
    model = CompletionLogprobs(load_backbone(assets["gpt_modern"]))
    sequences = make_sequences([[5, 17, 42], [9, 3]], [[7, 8, 9, 10], [11, 12], [13], [14, 15, 16]], 2, 0)
    batch = RolloutBatch.of(sequences, advantages=torch.tensor([1.0, -0.5, 0.25, -2.0]),
                            weights=torch.tensor([1.0, 1.0, 3.0, 3.0]))
    batch.mask[0, 1] = 0.0
    cfg = LossConfig(loss_agg=agg, beta=0.0)
    logp = token_logprobs(model, batch, 2, torch.device("cpu"), torch.autocast("cpu", enabled=False)).double()
    mask, adv, w = batch.mask.double(), batch.advantages.double()[:, None], batch.weights.double()
    if agg == "token":
        N = (w[:, None] * mask).sum()
        want, ours = -(adv * logp * w[:, None] * mask).sum() / N, -(adv * w[:, None] * mask).sum() / N
    else:
        per_seq = lambda x: (x * mask).sum(1) / mask.sum(1)  # noqa: E731
        want, ours = -(w * per_seq(adv * logp)).sum() / w.sum(), -(w * per_seq(adv.expand_as(mask))).sum() / w.sum()
    stats = dict(zip(LOSS_STATS, policy_backward(model, batch, 2, cfg, torch.device("cpu"),
                                                 torch.autocast("cpu", enabled=False)).tolist()))
    assert stats["pg_objective"] == pytest.approx(want.item(), rel=1e-5)
    assert stats["loss"] == pytest.approx(ours.item(), rel=1e-5) and abs(want - ours) > 0.1


def test_overlong_penalty_is_dapos_soft_punishment():
    from nanochat_ext.algorithms.rewards import overlong_penalty

    got = overlong_penalty(torch.tensor([10, 12, 14, 16]), max_new_tokens=16, buffer=4, penalty=0.5)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.25, -0.5], dtype=torch.float64))


def test_trl_loss_types_are_aliases():
    from scripts.kat_train_grpo import parse_args

    base = ["--policy", "x", "--prompts", "y"]
    for trl, ours in (("dapo", "token"), ("bnpo", "token"), ("grpo", "sequence"), ("dr_grpo", "dr_grpo")):
        assert parse_args(base + ["--loss_type", trl]).loss_agg == ours
    assert parse_args(base).loss_agg == "token" and parse_args(base).std_mode == "sample"


def test_dynamic_sampling_keeps_groups_with_a_spread_in_global_order_then_fills():
    def group(i, rewards):
        return Rollout([i], [[i]] * len(rewards), [False] * len(rewards),
                       torch.tensor(rewards, dtype=torch.float64)[:, None])

    # Two ranks, two prompts each: rank r's j-th group is global position r + 2j.
    parts = [[group(0, [1, 1]), group(2, [0, 1])], [group(1, [0, 2]), group(3, [5, 5])]]
    groups = in_global_order(parts)
    assert [g.indices[0] for g in groups] == [0, 1, 2, 3]
    flat = zero_std_groups(torch.cat([g.rewards[:, 0] for g in groups]), 2).tolist()
    assert flat == [True, False, False, True]
    kept = SignalFilter(batch_size=3)
    kept.add(groups, flat)
    assert not kept.full  # two groups with a spread, three wanted: draw again
    batch, filled = kept.batch()  # ... or, out of draws, top up with the first flat group
    assert [g.indices[0] for g in batch] == [1, 2, 0] and filled == 1
    kept.add([group(4, [0, 3]), group(5, [2, 2])], [False, True])
    batch, filled = kept.batch()
    assert kept.full and [g.indices[0] for g in batch] == [1, 2, 4] and filled == 0
    mine = Rollout.concat(batch[0::2], 1)  # rank 0 of 2 trains positions 0 and 2
    assert mine.indices == [1, 4] and mine.rewards[:, 0].tolist() == [0, 2, 0, 3] and mine.groups()[1].indices == [4]


@pytest.mark.parametrize("model", ["gpt_modern", "llama", "hf"])
def test_shared_prompt_rows_give_the_same_logprobs_and_gradients(model, assets):
    """make_sequences(share_prompt=True): one row per group (what its sequences share once, then the rest
    of each, see PrefixTree) gives every completion token the log-prob, entropy and gradient of one row
    per completion. Ragged prompts and completions, an empty completion, a group whose completions all
    begin alike (shared past the prompt) and one that is only that beginning; two micro-batches of a
    group each, as accumulate_backward slices them. A transformers model (hf) runs the rows unshared."""
    bb = load_backbone(assets["gpt_modern" if model == "gpt_modern" else "hf"], native=model != "hf")
    logprobs = CompletionLogprobs(bb, temperature=0.8)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 300, (n,), generator=g).tolist() for n in (9, 30)]
    completions = [torch.randint(1, 300, (n,), generator=g).tolist() for n in (5, 12, 1, 0, 5, 1, 10, 0)]
    common = torch.randint(1, 300, (2,), generator=g).tolist()
    completions[4:] = [common + c for c in completions[4:]]
    G = 4
    results = []
    for share in (False, True):
        batch = make_sequences(prompts, completions, G, 0, share)
        assert batch.input_ids.size(0) == (2 if share else 8)
        if share:
            assert bb.shares_prefixes(batch.branches) == bb.native
            # Shared: the prompt less its last token (the empty completion's branch); the prompt and the first
            # common token (the completion that is only the common tokens keeps the second).
            assert batch.branches[:, 0].tolist() == [8, 31]
        bb.zero_grad()
        logp, entropy = [], []
        for a in (0, 4):
            b = batch.micro_batch(slice(a, a + 4))
            lp, ent = logprobs(b.input_ids, b.gather, b.target, b.branches)
            (lp * b.mask).sum().backward()
            logp.append(torch.nn.functional.pad(lp * b.mask, (0, 12 - lp.size(1))).detach())
            entropy.append(torch.nn.functional.pad(ent * b.mask, (0, 12 - lp.size(1))))
        results.append((torch.cat(logp), torch.cat(entropy), {n: p.grad.clone() for n, p in bb.named_parameters()
                                                               if p.grad is not None}))
    (want, want_ent, want_grads), (got, got_ent, got_grads) = results
    assert (want != 0).sum() == sum(map(len, completions))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_ent, want_ent, atol=1e-5, rtol=1e-5)
    assert got_grads.keys() == want_grads.keys()
    for n, grad in want_grads.items():
        torch.testing.assert_close(got_grads[n], grad, atol=1e-5, rtol=1e-4, msg=n)
    with pytest.raises(ValueError, match="split a group of 4"):
        make_sequences(prompts, completions, G, 0, True).micro_batch(slice(0, 2))


def test_prefix_trees_are_used_where_they_cost_fewer_flops():
    """A tree pays when its rows share a prefix: the projections run on it once, and attention costs what
    rows of their own cost (TreeAttention), plus padding to the longest prefix and branch. With nothing or
    almost nothing shared, that padding makes rows of their own cheaper."""
    assert PrefixTree.pays(torch.tensor([[35, 32, 32, 32, 32, 32, 32, 32, 32]]), 256)  # the GRPO bench's group
    assert PrefixTree.pays(torch.tensor([[34, 22, 22]]), 256)  # an RM bench pair
    assert PrefixTree.pays(torch.tensor([[512] + [512] * 16]), 1280)  # 16 x 512 tokens after a 512 prompt
    assert not PrefixTree.pays(torch.tensor([[0, 40, 40]]), 64)  # nothing shared
    assert not PrefixTree.pays(torch.tensor([[2, 512, 8]]), 64)  # 2 tokens shared, the short branch padded to 512


def test_prefix_tree_names_its_real_tokens_where_the_pads_are_worth_skipping():
    """PrefixTree.real_tokens: the positions of the (B * T) layout that are not padding, for the MLP to run
    on alone (add_mlp; the equivalence tests above and transformers' logits in test_model cover its
    outputs), when the pads are 1/16 of the tokens or more; None when fewer, where picking and putting
    back would cost more than the pads."""
    tree = PrefixTree.from_lengths(torch.tensor([[3, 2, 1], [1, 1, 1]]))  # rows of 6 and 3 tokens: 3 pads
    assert tree.real_tokens.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert PrefixTree.from_lengths(torch.tensor([[3, 2, 1], [3, 1, 2]])).real_tokens is None  # no pads
    one_pad = PrefixTree.from_lengths(torch.tensor([[30, 2, 2]] * 15 + [[29, 2, 2]]))  # 1 pad in 544
    assert one_pad.real_tokens is None
    many_pads = PrefixTree.from_lengths(torch.tensor([[30, 2, 2]] * 14 + [[1, 1, 1]] * 2))
    assert many_pads.real_tokens.numel() == 14 * 34 + 2 * 3


class _Declared(dict):
    """A window's sums where reading one the metric did not declare fails."""

    def __init__(self, allowed: set[str], values: dict[str, float]):
        super().__init__(values)
        self.allowed = allowed

    def __getitem__(self, key: str) -> float:
        if key not in self.allowed:
            raise KeyError(f"reads {key!r}, not among its declared sums")
        return super().__getitem__(key)


def test_each_metric_reads_only_the_sums_it_declares():
    """grpo_metrics.METRICS declares each metric's sums beside its formula, and WINDOW is made from them: a formula
    that reads an undeclared sum would log from a sum nobody adds to. Every metric, given only its own sums and the
    counts every Window reads (COUNTS), computes; a reward's mean reads its reward_<name>."""
    from nanochat_ext.algorithms.grpo_metrics import COUNTS, METRICS, WINDOW, Window

    values = {k: 2.0 + i for i, k in enumerate(WINDOW)} | {"reward_a": 1.5}
    for metric in METRICS:
        allowed = {*metric.sums, *COUNTS} | ({"reward_a"} if metric.per_reward else set())
        w = Window(_Declared(allowed, values), 2, 3.0, 1e12, ("a",), True)
        value = metric.formula(w, "a") if metric.per_reward else metric.formula(w)
        assert value == value and metric.when(w), metric.name  # finite here, and logged with these sums
    assert set(WINDOW) >= {s for m in METRICS for s in m.sums}


def test_a_batch_field_declares_a_layout_slicing_knows():
    """Sequences' fields declare how a micro-batch cuts them (per row, completion or token): an unknown layout is
    refused where it is declared, and a trainer's own field cannot claim the rows, which Sequences alone lays out."""
    import dataclasses

    from nanochat_ext.training.logprobs import Sequences, per

    with pytest.raises(ValueError, match="layout"):
        per("tokens")

    @dataclasses.dataclass(slots=True, eq=False)
    class Rowed(Sequences):
        extra: torch.Tensor | None = per("row")

    batch = Rowed.of(make_sequences([[5, 17, 42]], [[7, 8], [9]], 2, 0), extra=torch.zeros(2))
    with pytest.raises(TypeError, match="only input_ids and branches"):
        batch.micro_batch(slice(0, 2))
