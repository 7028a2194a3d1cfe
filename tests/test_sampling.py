"""The sampling rules, and the engine's eager KV-cache generation sampling what a full re-forward gives (up to
ties), for the nanochat GPT and an HF model."""
from __future__ import annotations

import pytest
import torch

from nanochat_ext.engine.engine import Engine
from nanochat_ext.engine.sampling import SCAN_CHUNK, SamplingConfig, cumsum_in_chunks, filter_logits, sample_token
from nanochat_ext.models.loader import load_backbone

# Two computations of the same logits (cached or re-forward, compiled or eager, another batch) agree to a
# few ulps, not bitwise, and which pairs are bitwise equal depends on the CPU's kernels. A token can then
# differ only where its uniform falls that close to a CDF boundary (greedy: where the top two logits are
# that close): a tie, not a bug. TIE is far above that noise (~1e-7) and far below a token's share of the
# probability at these vocabularies (~2e-3), so a generator that samples from other logits still fails.
TIE = 1e-5


def is_tie(logits: torch.Tensor, u: torch.Tensor, token: int, cfg: SamplingConfig) -> bool:
    """Whether `token` is within TIE of what sample_token takes from `logits` (1, V) at uniform u: a token the
    filters kept whose CDF interval (low, high] lies within TIE of u's point (greedy: of the top logit)."""
    if cfg.temperature == 0:
        return bool(logits[0, token] >= logits.max() - TIE)
    cdf = torch.softmax(filter_logits(logits.float(), cfg), dim=-1)[0].double().cumsum(0)
    target = float(u) * float(cdf[-1])
    low, high = (float(cdf[token - 1]) if token else 0.0), float(cdf[token])
    return high > low and low - TIE <= target <= high + TIE


def assert_sampled_from_reforward(model, prompts, G, cfg, stop_ids, generators, got) -> None:
    """Each token of `got` is the one sample_token takes at its uniform from logits of a full re-forward
    (no cache, one unpadded sequence at a time, fed the tokens `got` sampled before it; every stop id held back
    before min_new_tokens), or a tie with it; a completion ends at its first stop token (any of stop_ids: an id or
    several), or at max_new_tokens, as its truncated flag says."""
    stops = [stop_ids] if isinstance(stop_ids, int) else list(stop_ids)
    assert len(got.completions) == len(prompts) * G
    for i, (p, g) in enumerate(zip(prompts, generators, strict=True)):
        uniforms = torch.rand(G, cfg.max_new_tokens, generator=g)
        for s in range(G):
            completion, truncated = got.completions[i * G + s], got.truncated[i * G + s]
            assert not set(stops) & set(completion[:-1]) and truncated == (completion[-1] not in stops)
            assert not truncated or len(completion) == cfg.max_new_tokens
            with torch.no_grad():
                logits = model(torch.tensor([p + completion[:-1]]))[0, len(p) - 1:].float()
            for t, token in enumerate(completion):
                row = logits[t:t + 1].clone()
                if t < cfg.min_new_tokens:
                    row[:, stops] = float("-inf")
                u = uniforms[s:s + 1, t]
                want = int(sample_token(row, u, cfg))
                assert token == want or is_tie(row, u, token, cfg), (i, s, t, token, want)


@pytest.mark.parametrize("name,native", [("gpt", True), ("gpt_modern", True), ("hf", True), ("hf", False)])
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 20, 0.9)])
def test_kv_cache_generation_matches_full_reforward(assets, name, native, temperature, top_k, top_p):
    model = load_backbone(assets[name], native=native)
    prompts = [[5, 17, 42, 99, 7], [3, 250], [11, 12, 13, 14, 15, 16, 17, 18]]  # ragged: left padding in play
    cfg = SamplingConfig(max_new_tokens=12, temperature=temperature, top_k=top_k, top_p=top_p)
    stop_id = 101  # random weights: rows stop at different times, or not at all
    gens = lambda: [torch.Generator().manual_seed(1000 + i) for i in range(len(prompts))]  # noqa: E731
    got = Engine(model).generate(prompts, 3, cfg, stop_id, 0, gens())
    assert_sampled_from_reforward(model, prompts, 3, cfg, stop_id, gens(), got)
    assert all(0 <= t < model.vocab_size for c in got.completions for t in c)


def test_sampling_repeats_with_the_same_seed_and_differs_with_another(assets):
    model = load_backbone(assets["gpt"])
    cfg = SamplingConfig(max_new_tokens=10, temperature=1.0)
    a = Engine(model).generate([[1, 2, 3]], 4, cfg, 5, 0, [torch.Generator().manual_seed(1)])
    b = Engine(model).generate([[1, 2, 3]], 4, cfg, 5, 0, [torch.Generator().manual_seed(1)])
    c = Engine(model).generate([[1, 2, 3]], 4, cfg, 5, 0, [torch.Generator().manual_seed(2)])
    assert a.completions == b.completions != c.completions
    assert len({tuple(x) for x in a.completions}) > 1  # the group's samples differ from each other


def test_min_new_tokens_holds_back_the_stop_token(assets):
    model = load_backbone(assets["gpt"])
    greedy = SamplingConfig(max_new_tokens=6, temperature=0.0)
    first = Engine(model).generate([[1, 2, 3]], 1, greedy, 0, 0, [torch.Generator()]).completions[0][0]
    # Greedy decoding would stop at once if `first` were the stop token...
    assert Engine(model).generate([[1, 2, 3]], 1, greedy, first, 0, [torch.Generator()]).completions == [[first]]
    # ...but not before min_new_tokens.
    held = SamplingConfig(max_new_tokens=6, temperature=0.0, min_new_tokens=3)
    out = Engine(model).generate([[1, 2, 3]], 1, held, first, 0, [torch.Generator()]).completions[0]
    assert len(out) >= 3 and first not in out[:3]


def test_top_k_and_top_p_filtering():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda cfg: torch.isfinite(filter_logits(logits, cfg))[0].tolist()  # noqa: E731
    assert kept(SamplingConfig(top_k=2)) == [True, True, False, False]
    assert kept(SamplingConfig(top_p=0.7)) == [True, True, False, False]
    assert kept(SamplingConfig(top_p=0.85)) == [True, True, True, False]


@pytest.mark.parametrize("name", ["gpt_modern", "hf"])
def test_kv_cache_is_held_in_the_autocast_dtype_with_the_same_logits(assets, name):
    """Under bf16 autocast (what CUDA runs) the cache stores bf16, half of fp32, and decoding gives
    bitwise the logits of an fp32 cache: attention reads keys and values in bf16 either way."""
    model = load_backbone(assets[name]).model
    ids = torch.tensor([[5, 17, 42, 99, 7, 3], [3, 250, 8, 9, 10, 11]])
    out = {}
    for cache_dtype in (torch.bfloat16, torch.float32):
        fp32_cache = model.new_kv_cache(2, 10)  # made outside autocast: the weights' fp32
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            cache = model.new_kv_cache(2, 10) if cache_dtype == torch.bfloat16 else fp32_cache
            assert all(t.dtype == cache_dtype for t in cache.k + cache.v)
            first = model(ids, kv_cache=cache)[:, -1]
            second = model(torch.tensor([[1], [2]]), kv_cache=cache)[:, -1]
        out[cache_dtype] = torch.cat([first, second])
    assert torch.equal(out[torch.bfloat16], out[torch.float32])  # the same bf16 operands to the same kernels


def test_a_tie_is_told_from_another_token():
    """The checker above admits a token only within TIE of the CDF boundary (greedy: of the top logit)."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    sampled, greedy = SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.0)
    near_boundary = torch.tensor([0.5 + 1e-6])  # just past token 0's CDF (0.5): token 1, token 0 a tie
    assert int(sample_token(logits, near_boundary, sampled)) == 1
    assert is_tie(logits, near_boundary, 0, sampled) and not is_tie(logits, near_boundary, 2, sampled)
    for u, token in ((0.4, 1), (0.25, 1), (0.65, 0), (0.9, 1)):  # inside another token's interval: no tie
        assert not is_tie(logits, torch.tensor([u]), token, sampled), (u, token)
    top1 = SamplingConfig(temperature=1.0, top_k=1)  # tokens 1 and 2 removed: never a tie, wherever u falls
    assert not any(is_tie(logits, torch.tensor([u]), t, top1) for u in (0.0, 0.5, 0.999999) for t in (1, 2))
    close = torch.tensor([[1.0, 1.0 - 1e-7, 0.0]])
    assert is_tie(close, near_boundary, 1, greedy) and not is_tie(close, near_boundary, 2, greedy)


def test_the_sampled_token_is_torchs_searchsorted_over_the_cdf():
    """sample_token takes the first token of probability > 0 whose cumulative sum exceeds u's point, else the last
    such token (inductor's CUDA lowering of searchsorted crashed on the chunked CDF): the index torch.searchsorted gives
    over the same sums (right=True, clamped to the last token that adds any), on ragged rows (a real vocabulary that is
    no multiple of the scan's chunk, runs of zero-probability tokens, top-k and top-p cutting most of a row away) and
    at u's ends (0, and 1.0, whose point is the row's total: the clamp's case)."""
    g = torch.Generator().manual_seed(0)
    V = 3 * SCAN_CHUNK + 77
    logits = torch.randn(6, V, generator=g) * 4
    logits[1, : V // 2] = float("-inf")  # a long run of zeros before the first token that adds any
    logits[2, V - 300:] = float("-inf")  # and after the last
    u = torch.rand(6, generator=g)
    u[3], u[2], u[4] = 0.0, 1.0, 1.0
    for cfg in (SamplingConfig(8, 1.0), SamplingConfig(8, 0.7, top_k=50), SamplingConfig(8, 1.3, top_p=0.5)):
        probs = torch.softmax(filter_logits(logits.float(), cfg), dim=-1)
        cdf = cumsum_in_chunks(probs)
        total = cdf[:, -1:]
        expect = torch.minimum(torch.searchsorted(cdf, u[:, None] * total, right=True),
                               torch.searchsorted(cdf, total)).squeeze(1)
        token = sample_token(logits, u, cfg)
        assert torch.equal(token, expect), (cfg, token, expect)
        assert (probs.gather(1, token[:, None]) > 0).all()  # never a token of probability 0
        assert token[2] == probs[2].nonzero().max() and token[4] == probs[4].nonzero().max()  # the clamp engaged
