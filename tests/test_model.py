"""Tokenizer wrapper, the nanochat-compatible GPT, backbone loading and checkpoint files."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat_ext.data.batching import TokenizedPair, collate_pairs, prefix_tree_rows
from nanochat_ext.errors import InputError
from nanochat_ext.models.attention import NO_WINDOW, PrefixTree, attend, attn_masks
from nanochat_ext.models.backbone import hold_frozen_in
from nanochat_ext.models.gpt import GPT, GPTConfig
from nanochat_ext.models.loader import default_tokenizer_path, load_backbone, load_tokenizer_for
from nanochat_ext.models.reward_model import RewardModel, RewardScorer
from nanochat_ext.models.vintages import VINTAGES
from nanochat_ext.runtime.checkpoint import find_checkpoint, new_stamp, save_checkpoint, write_text_atomic
from nanochat_ext.runtime.outdir import check_writable
from nanochat_ext.tasks import synthetic
from nanochat_ext.tokenizer import SPECIAL_TOKENS, TokenizerWrapper


def test_rustbpe_tokenizer_roundtrip_and_chat_rendering(assets):
    tok = TokenizerWrapper.load(assets["tokenizer"])
    assert tok.kind == "rustbpe" and tok.vocab_size == 512
    text = "Sure, gladly: the comet's orbit!"
    assert tok.decode(tok.encode(text)) == text
    ids = tok.render_prompt([{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}])
    specials = {tok.special(n): n for n in SPECIAL_TOKENS}
    assert [specials[i] for i in ids if i in specials] == ["<|bos|>", "<|user_start|>", "<|user_end|>",
                                                          "<|assistant_start|>"]
    assert tok.decode(ids) == "<|bos|><|user_start|>Be kind.\n\nHi<|user_end|><|assistant_start|>"
    assert tok.render_response("Yes")[-1] == tok.special("<|assistant_end|>")


def test_hf_tokenizer_fallback_uses_its_chat_template(assets):
    tok = TokenizerWrapper.load(assets["hf"])
    assert tok.kind == "hf"
    ids = tok.render_prompt([{"role": "user", "content": "Hi"}])
    assert tok._impl.decode(ids) == "<|user|>Hi<|endoftext|><|assistant|>"
    assert tok.render_response("Yes")[-1] == tok.eos_id


def test_no_tokenizer_names_both_tries(tmp_path):
    with pytest.raises(InputError, match="tokenizer.pkl.*and.*tokenizer.json"):
        TokenizerWrapper.load(tmp_path)


@pytest.mark.parametrize("vintage", list(VINTAGES))
def test_right_padding_does_not_change_the_last_real_token(vintage):
    cfg = GPTConfig(sequence_len=16, vocab_size=300, n_layer=3, n_head=4, n_kv_head=2, n_embd=64, vintage=vintage,
                    window_pattern="SL", padded_vocab_size=320)
    model = GPT(cfg)
    model.init_weights(0)
    ids = torch.randint(0, 300, (1, 12))  # longer than jan/feb2026's short window (8): the sliding mask is used
    padded = torch.cat([ids, torch.zeros(1, 5, dtype=torch.long)], 1)
    with torch.no_grad():
        a, b = model.hidden_states(ids), model.hidden_states(padded)
        assert model(ids).shape == (1, 12, 300)  # padded vocab rows are cut from the logits
    torch.testing.assert_close(a[0, -1], b[0, 11])


def test_sliding_window_masks():
    cfg = GPTConfig(sequence_len=8, vocab_size=300, n_layer=2, n_head=2, n_kv_head=2, n_embd=32, window_pattern="S",
                    vintage="jan2026")
    model = GPT(cfg)
    assert model.window_sizes == [4, 8]  # S is half the context in Jan 2026; last layer always full context
    for vintage, short in (("mar2026b", 256), ("current", 128), ("oct2025", NO_WINDOW)):  # ceil(L/3|4 / 128) * 128
        cfg = GPTConfig(sequence_len=512, n_layer=2, window_pattern="S", vintage=vintage)
        assert GPT._window_sizes(cfg) == [short, 512 if vintage != "oct2025" else NO_WINDOW]
    short, full = attn_masks(model.window_sizes, 6, 0, None, torch.device("cpu"))
    assert full is None
    i, j = torch.meshgrid(torch.arange(6), torch.arange(6), indexing="ij")
    assert torch.equal(short, (j <= i) & (i - j <= 4))


def test_nanochat_checkpoint_quirks_load(tmp_path, assets):
    """nanochat saves bf16 tensors, sometimes with torch.compile's `_orig_mod.` prefix; meta has model_config."""
    src = load_backbone(assets["gpt_modern"])
    state = {"_orig_mod." + k: v.bfloat16() for k, v in src.model.state_dict().items()}
    meta = json.loads(find_checkpoint(assets["gpt_modern"])[1].read_text())
    assert set(meta["model_config"]) == {"sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd",
                                         "window_pattern"}
    del meta["nanochat_vintage"]  # as nanochat writes it: the keys alone say "current"
    save_checkpoint(tmp_path / "in", 123, state, meta)
    bb = load_backbone(tmp_path / "in")
    assert bb.vintage == "current" and "value_embeds.1.weight" in bb.model.state_dict()
    classic = load_backbone(assets["gpt"])
    assert classic.vintage == "oct2025" and not hasattr(classic.model, "value_embeds")
    # Saved back in its own layout: same keys (as nanochat's loader sees them) and dtypes, config verbatim.
    with torch.no_grad():
        bb.model.lm_head.weight.add_(0.5)
    saved = bb.save(tmp_path / "out", 5, {"step": 1}, TokenizerWrapper.load(assets["tokenizer"]), {"step": 1})
    back = torch.load(saved, weights_only=True)
    assert {k: v.dtype for k, v in back.items()} == {k.removeprefix("_orig_mod."): v.dtype for k, v in state.items()}
    assert json.loads((tmp_path / "out" / "meta_5.json").read_text())["model_config"] == meta["model_config"]
    fp32 = torch.load(tmp_path / "out" / "state_5.pt", weights_only=True)["fp32_masters"]
    assert set(fp32) == set(back) and fp32["lm_head.weight"].dtype == torch.float32  # resume keeps full precision


def test_foreign_state_dict_is_a_clear_error(tmp_path):
    save_checkpoint(tmp_path, 1, {"transformer.wte.weight": torch.zeros(10, 4), "something.else": torch.zeros(1)},
                    {"model_config": {"vocab_size": 10, "n_layer": 1, "n_head": 1, "n_kv_head": 1, "n_embd": 4}})
    with pytest.raises(InputError, match="state dict does not fit a nanochat GPT"):
        load_backbone(tmp_path)


@pytest.mark.parametrize("native", [True, False])
def test_hf_backbone_and_partial_unfreeze(assets, native):
    bb = load_backbone(assets["hf"], native=native)
    assert bb.kind == "hf" and bb.hidden_size == 64 and bb.native == native
    ids = torch.randint(0, 300, (2, 7))
    assert bb.hidden_states(ids).shape == (2, 7, 64) and bb(ids).shape[-1] == bb.vocab_size
    bb.set_trainable(1)
    trainable = {n for n, p in bb.named_parameters() if p.requires_grad}
    assert trainable and all(".layers.1." in n or n.endswith("norm.weight") or n == "model.norm" for n in trainable)
    bb.set_trainable("all")
    assert all(p.requires_grad for p in bb.parameters())
    with pytest.raises(InputError, match="--unfreeze_last must be 0..2"):
        bb.set_trainable(3)


def test_tokenizer_found_beside_a_nanochat_base_dir(tmp_path, assets, monkeypatch):
    base = tmp_path / "base"
    synthetic.make_tiny_gpt(base / "chatsft_checkpoints" / "d2", 512)
    TokenizerWrapper.load(assets["tokenizer"]).save(base / "tokenizer")
    assert default_tokenizer_path(base / "chatsft_checkpoints" / "d2") == base / "tokenizer"
    bb = load_backbone(base / "chatsft_checkpoints" / "d2")
    assert load_tokenizer_for(bb, None).kind == "rustbpe"


def test_checkpoint_lookup_takes_newest_complete(tmp_path):
    save_checkpoint(tmp_path, 100, {"w": torch.zeros(1)}, {"step": 1}, {"step": 1})
    save_checkpoint(tmp_path, 200, {"w": torch.ones(1)}, {"step": 2})
    (tmp_path / "model_300.pt").write_bytes(b"half")  # crashed before its meta: not complete
    (tmp_path / "model_400.pt.tmp").write_bytes(b"half")
    assert find_checkpoint(tmp_path) == (tmp_path / "model_200.pt", tmp_path / "meta_200.json")
    assert find_checkpoint(tmp_path / "model_100.pt")[1] == tmp_path / "meta_100.json"
    assert new_stamp(tmp_path) > 200


def test_check_writable(tmp_path):
    assert check_writable(tmp_path / "new" / "dir") is None and (tmp_path / "new" / "dir").is_dir()
    assert list((tmp_path / "new" / "dir").iterdir()) == []
    (tmp_path / "f").write_text("x")
    assert "cannot be written" in check_writable(tmp_path / "f" / "sub")


def test_an_atomic_write_that_fails_leaves_no_temporary_file(tmp_path):
    (tmp_path / "taken").mkdir()  # the rename onto a directory fails after the temporary file is written
    with pytest.raises(OSError):
        write_text_atomic(tmp_path / "taken", "text")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
    write_text_atomic(tmp_path / "fresh.jsonl", "a\nb\n")
    assert (tmp_path / "fresh.jsonl").read_text() == "a\nb\n" and len(list(tmp_path.iterdir())) == 2


def test_native_llama_matches_transformers(assets, tmp_path):
    """Our Llama gives transformers' logits, and what it saves transformers loads back unchanged."""
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 500, (3, 20))
    hf = load_backbone(assets["hf"], native=False)
    ours = load_backbone(assets["hf"])
    assert ours.native and not hf.native
    with torch.no_grad():
        want = hf(ids)
        torch.testing.assert_close(ours(ids), want, atol=1e-4, rtol=1e-4)
        with torch.no_grad():
            for p in ours.parameters():
                p.add_(0.01)
        tok = TokenizerWrapper.load(assets["hf"])
        saved = ours.save(tmp_path, 7, {"step": 0}, tok)
        assert saved == tmp_path / "model_7" and (saved / "tokenizer.json").is_file()
        reloaded = AutoModelForCausalLM.from_pretrained(str(saved), local_files_only=True)
        torch.testing.assert_close(reloaded(ids).logits.float(), ours(ids), atol=1e-4, rtol=1e-4)
        assert not torch.allclose(reloaded(ids).logits.float(), want, atol=1e-3)


@pytest.mark.parametrize("vintage,layers", [*((v, 3) for v in VINTAGES), ("current", 1), ("llama", 2)])
def test_scored_positions_only_equal_the_full_forward(vintage, layers, assets, tmp_path):
    """The RM path (`at`): the last block runs its queries and MLP at each row's scored position only,
    and gives the same hidden state and the same gradients as the full forward read at that position
    (one layer: today's backout is then taken from the last block itself)."""
    if vintage == "llama":
        bb = load_backbone(assets["hf"])
    else:
        bb = load_backbone(synthetic.make_tiny_gpt(tmp_path / vintage, 300, seed=3, vintage=vintage, n_layer=layers))
    bb.set_trainable(1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (4, 40), generator=g)
    at = torch.tensor([39, 5, 20, 0])  # right-padded rows of lengths 40, 6, 21, 1
    w = torch.randn(bb.hidden_size, generator=g)  # a reward head (a sum of squares of normed states is constant)
    full = bb.hidden_states(ids)[torch.arange(4), at]
    (full @ w).sum().backward()
    grads = {n: p.grad.clone() for n, p in bb.named_parameters() if p.requires_grad}
    bb.zero_grad()
    picked = bb.hidden_states(ids, at=at)
    (picked @ w).sum().backward()
    torch.testing.assert_close(picked, full, atol=1e-5, rtol=1e-5)
    for n, p in bb.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, grads[n], atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("vintage,layers", [*((v, 3) for v in VINTAGES), ("current", 1), ("llama", 2),
                                            ("llama_window", 2), ("hf", 2)])
def test_pair_rows_equal_separate_rows(vintage, layers, assets, tmp_path, monkeypatch):
    """The RM's pair rows (collate_pairs: the tokens chosen and rejected share, once, then the rest of
    each) give every pair the rewards and gradients of chosen and rejected run as rows of their own.
    Prompts up to past the short window (128), no shared token at all, one-token branches, a chosen that
    is a prefix of rejected; every parameter trainable. A transformers model (hf) takes the unshared
    path, which must agree too; llama_window puts a 16-token window in every layer. The tree is forced:
    for so ragged a batch at hidden 64 the cost model may prefer rows of their own (PrefixTree.pays has
    its own test)."""
    monkeypatch.setattr(PrefixTree, "pays", staticmethod(lambda lengths, hidden_size: True))
    if vintage in ("llama", "llama_window", "hf"):
        bb = load_backbone(assets["hf"], native=vintage != "hf")
        if vintage == "llama_window":  # a sliding window in every layer (Mistral-style), the scored one too
            bb.model.window_sizes = [16] * len(bb.blocks)
    else:
        bb = load_backbone(synthetic.make_tiny_gpt(tmp_path / vintage, 300, seed=3, vintage=vintage, n_layer=layers))
    bb.set_trainable("all")
    model = RewardModel(bb)
    model.init_head(0)
    g = torch.Generator().manual_seed(1)

    def ids(n: int) -> list[int]:
        return torch.randint(1, 300, (n,), generator=g).tolist()

    pairs = []
    for prompt, a, b in [(100, 60, 30), (0, 5, 7), (20, 1, 1), (57, 40, 3)]:
        p = ids(prompt)
        pairs.append(TokenizedPair(p + ids(a), p + ids(b), 1.0))
    chosen = ids(30)
    pairs.append(TokenizedPair(chosen, chosen + ids(9), 1.0))
    batch = collate_pairs(pairs, pad_id=0)
    assert batch["lengths"].tolist()[:3] == [[100, 60, 30], [0, 5, 7], [20, 1, 1]]
    assert batch["lengths"].tolist()[4] == [29, 1, 10]  # each side keeps a token of its own
    assert bb.shares_prefixes(batch["lengths"]) == bb.native  # the tree really runs (hf: unshared)
    seqs = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    separate = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    for i, s in enumerate(seqs):
        separate[i, :len(s)] = torch.tensor(s)
    weights = torch.randn(len(seqs), generator=g)
    results = []
    for rows, lengths in [(separate, torch.tensor([len(s) for s in seqs])), (batch["input_ids"], batch["lengths"])]:
        model.zero_grad()
        rewards = model(rows, lengths)
        (rewards * weights).sum().backward()
        results.append((rewards.detach(),
                        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got_grads.keys() == want_grads.keys() and len(got_grads) > 10
    for n, grad in want_grads.items():
        torch.testing.assert_close(got_grads[n], grad, atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("native", [True, False])
def test_grouped_scoring_equals_one_sequence_per_row(native, assets):
    """RewardScorer.score_ids(group=G), as GRPO scores a prompt's G samples: each run of G sequences is
    one PrefixTree row (their common prefix once), and the scores are those of one row per sequence.
    Ragged samples, two identical ones, one a prefix of another; one group per forward and all at once."""
    bb = load_backbone(assets["gpt_modern"] if native else assets["hf"], native=native)
    tok = TokenizerWrapper.load(assets["tokenizer"] if native else assets["hf"])
    model = RewardModel(bb)
    model.init_head(0)
    scorer = RewardScorer(model, tok, 256, {})
    g = torch.Generator().manual_seed(2)

    def ids(n: int) -> list[int]:
        return torch.randint(1, 300, (n,), generator=g).tolist()

    seqs = []
    for prompt_len in (12, 40, 3):
        prompt = ids(prompt_len)
        same = ids(6)
        seqs += [prompt + ids(9), prompt + same, prompt + same, prompt + same[:2]]
    want = scorer.score_ids(seqs)
    assert bb.shares_prefixes(torch.tensor(prefix_tree_rows([seqs[:4], seqs[4:8]])[1])) == native
    for batch_size in (5, 32):
        torch.testing.assert_close(torch.tensor(scorer.score_ids(seqs, batch_size, group=4)), torch.tensor(want),
                                   atol=1e-5, rtol=1e-5)
    assert want[1] == pytest.approx(want[2], abs=1e-5) and want[0] != pytest.approx(want[1], abs=1e-3)
    with pytest.raises(ValueError, match="do not split into groups of 5"):
        scorer.score_ids(seqs, group=5)


def test_native_llama_prefix_tree_rows_match_transformers(assets):
    """Ragged prefix-tree rows (prefixes of 40, 0 and 5 tokens, branches of 1 to 25, a third of the
    batch padding, so the MLP runs on the real tokens alone) through our Llama give, for every branch
    token, the logits transformers' own LlamaForCausalLM gives for prefix + branch run alone."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(assets["hf"]), local_files_only=True).eval()
    ours = load_backbone(assets["hf"])
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([[40, 7, 3], [0, 12, 25], [5, 1, 1]])
    rows = [torch.randint(2, 500, (int(n),), generator=g) for n in lengths.sum(-1)]
    ids = torch.zeros(3, max(len(r) for r in rows), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    tree = PrefixTree.from_lengths(lengths)
    assert tree.real_tokens is not None  # the packed MLP path runs
    with torch.no_grad():
        got = ours.model.logits(ours.model.hidden_states(ids, tree=tree))
        for i, (prefix, a, b) in enumerate(lengths.tolist()):
            for start, n in ((prefix, a), (prefix + a, b)):
                alone = torch.cat([rows[i][:prefix], rows[i][start:start + n]])[None]
                want = hf(alone).logits[0, prefix:]
                torch.testing.assert_close(got[i, start:start + n], want, atol=1e-4, rtol=1e-4, msg=f"row {i}")


def test_matmuls_only_holds_linear_weights_in_bf16_but_not_a_tied_embedding():
    """GRPO's reference (hold_frozen_in matmuls_only): linear weights and biases in bf16, which autocast
    casts anyway; an embedding, and a linear weight tied to it (an LM head sharing the input table, which
    the lookup reads in full precision), stay fp32; trainable weights are never touched."""
    embed, tied, proj, trained = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False), nn.Linear(4, 4), nn.Linear(4, 4)
    tied.weight = embed.weight
    model = nn.ModuleList([embed, tied, proj, trained]).requires_grad_(False)
    trained.requires_grad_(True)
    hold_frozen_in(model, torch.bfloat16, matmuls_only=True)
    assert embed.weight.dtype == torch.float32 and tied.weight is embed.weight
    assert proj.weight.dtype == proj.bias.dtype == torch.bfloat16
    assert trained.weight.dtype == torch.float32
    hold_frozen_in(model, torch.bfloat16)  # the RM's and eval's rule: every frozen weight
    assert embed.weight.dtype == torch.bfloat16 and trained.weight.dtype == torch.float32


def test_cpu_attention_outside_decoding_runs_in_fp32_under_bf16_autocast():
    """torch's CPU attention takes 2-4x as long in bf16 (forward and backward) as in fp32: under CPU bf16 autocast,
    attention outside decoding is torch's fp32 SDPA of its inputs, trained (fp32 gradients) or not (the same values: a
    reference equal to the policy gives KL 0), and attention over a KV cache's keys and values (a prefill, a decode
    step) is what autocast computes (bf16), as before."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 7, 8, generator=g) for h in (4, 2, 2))  # GQA, as the Llama family's
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = torch.rand(2, 1, 1, 7, generator=g) > 0.3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        trained, frozen = attend(*leaves, None), attend(q, k, v, None)
        prefill, prefill_want = attend(q, k, v, None, cached=True), F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True)
        step, step_want = attend(q[:, :, -1:], k, v, mask, cached=True), F.scaled_dot_product_attention(
            q[:, :, -1:], k, v, attn_mask=mask, enable_gqa=True)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert trained.dtype == frozen.dtype == torch.float32
    assert prefill.dtype == step.dtype == step_want.dtype == prefill_want.dtype == torch.bfloat16
    assert torch.equal(trained, want) and torch.equal(frozen, want)
    assert torch.equal(prefill, prefill_want) and torch.equal(step, step_want)
    trained.sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.float32 for t in leaves)
