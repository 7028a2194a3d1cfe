"""KV-cache and compiled generation sample what a full re-forward gives (up to ties), for the nanochat GPT
and an HF model."""
from __future__ import annotations

import pytest
import torch

from nanochat_ext.backbone import load_backbone
from nanochat_ext.compiled import compile_stats
from nanochat_ext.sampling import (COMPILE_PAYS_AFTER, SamplingConfig, decode_compiled, filter_logits, generate,
                                    sample_token, static_step)


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


def assert_sampled_from_reforward(model, prompts, G, cfg, stop_id, generators, got) -> None:
    """Each token of `got` is the one sample_token takes at its uniform from logits of a full re-forward
    (no cache, one unpadded sequence at a time, fed the tokens `got` sampled before it), or a tie with it;
    a completion ends at its first stop token, or at max_new_tokens, as its truncated flag says."""
    assert len(got.completions) == len(prompts) * G
    for i, (p, g) in enumerate(zip(prompts, generators, strict=True)):
        uniforms = torch.rand(G, cfg.max_new_tokens, generator=g)
        for s in range(G):
            completion, truncated = got.completions[i * G + s], got.truncated[i * G + s]
            assert stop_id not in completion[:-1] and truncated == (completion[-1] != stop_id)
            assert not truncated or len(completion) == cfg.max_new_tokens
            with torch.no_grad():
                logits = model(torch.tensor([p + completion[:-1]]))[0, len(p) - 1:].float()
            for t, token in enumerate(completion):
                row = logits[t:t + 1].clone()
                if t < cfg.min_new_tokens:
                    row[:, stop_id] = float("-inf")
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
    got = generate(model, prompts, 3, cfg, stop_id, 0, gens())
    assert_sampled_from_reforward(model, prompts, 3, cfg, stop_id, gens(), got)
    assert all(0 <= t < model.vocab_size for c in got.completions for t in c)


def test_sampling_repeats_with_the_same_seed_and_differs_with_another(assets):
    model = load_backbone(assets["gpt"])
    cfg = SamplingConfig(max_new_tokens=10, temperature=1.0)
    a = generate(model, [[1, 2, 3]], 4, cfg, 5, 0, [torch.Generator().manual_seed(1)])
    b = generate(model, [[1, 2, 3]], 4, cfg, 5, 0, [torch.Generator().manual_seed(1)])
    c = generate(model, [[1, 2, 3]], 4, cfg, 5, 0, [torch.Generator().manual_seed(2)])
    assert a.completions == b.completions != c.completions
    assert len({tuple(x) for x in a.completions}) > 1  # the group's samples differ from each other


def test_min_new_tokens_holds_back_the_stop_token(assets):
    model = load_backbone(assets["gpt"])
    greedy = SamplingConfig(max_new_tokens=6, temperature=0.0)
    first = generate(model, [[1, 2, 3]], 1, greedy, 0, 0, [torch.Generator()]).completions[0][0]
    # Greedy decoding would stop at once if `first` were the stop token...
    assert generate(model, [[1, 2, 3]], 1, greedy, first, 0, [torch.Generator()]).completions == [[first]]
    # ...but not before min_new_tokens.
    held = SamplingConfig(max_new_tokens=6, temperature=0.0, min_new_tokens=3)
    out = generate(model, [[1, 2, 3]], 1, held, first, 0, [torch.Generator()]).completions[0]
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


@pytest.mark.parametrize("name,temperature", [("gpt_modern", 1.0), ("hf", 0.0)])
def test_compiled_static_decode_samples_the_same_tokens(assets, name, temperature):
    """--compile 1: a torch.compile'd static-shape decode step (cache slots written in place, masks as
    tensors) samples what eager decoding and a full re-forward give for the same uniforms: left-padded
    prompts of three lengths, today's nanochat (smear, windows, value embeddings) at temperature 1 and the
    Llama greedy (each a graph of its own to compile; the sampler does not depend on the model)."""
    bb = load_backbone(assets[name])
    prompts = [list(range(5, 29)), list(range(7, 12)), list(range(40, 55))]
    torch._dynamo.reset()  # compiled here, whatever earlier tests compiled
    seeds = lambda: [torch.Generator().manual_seed(i) for i in range(3)]  # noqa: E731

    def run(compiled: bool, stop_id: int):
        cfg = SamplingConfig(20, temperature, min_new_tokens=3, compile=compiled)
        return generate(bb, prompts, 3, cfg, stop_id, 0, seeds())

    # greedy: the stop token is what row 0 picks 4th, so rows stop at different steps (the loop goes on for
    # the others, pads after a stop) and the ban before min_new_tokens is exercised
    stop_id = 1 if temperature else run(False, 1).completions[0][3]
    eager, graphs = run(False, stop_id), compile_stats()[0]
    compiled = run(True, stop_id)
    for samples in (eager, compiled):  # logits a few ulps from a re-forward's: each token its, or a tie
        assert_sampled_from_reforward(bb, prompts, 3, SamplingConfig(20, temperature, min_new_tokens=3), stop_id,
                                      seeds(), samples)
    if not temperature:
        assert len(eager.completions[0]) == 4 and True in eager.truncated
    # the compiled step ran (a graph was compiled for it), whole: sampling and decoding in one graph
    assert static_step in bb._compiled and compile_stats()[0] > graphs
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])


def test_compile_auto_compiles_where_the_compile_pays_back(monkeypatch):
    """--compile auto: compiled on CPU for a run that decodes COMPILE_PAYS_AFTER token steps or more, with
    a C++ compiler for inductor; eager for shorter runs (the demo's 200 x 16), without a compiler, and
    on CUDA. 0 and 1 are obeyed as given."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    n = -(-COMPILE_PAYS_AFTER // 64)  # the fewest steps of 64 tokens that reach it
    assert decode_compiled("auto", cpu, n, 64)[0] and not decode_compiled("auto", cpu, n - 1, 64)[0]
    off, why = decode_compiled("auto", cpu, 200, 16)
    assert not off and "3200 token steps" in why
    assert not decode_compiled("auto", cuda, 10 * n, 64)[0]
    assert decode_compiled("1", cuda, 1, 1)[0] and not decode_compiled("0", cpu, 10 * n, 64)[0]
    from torch._inductor import config as inductor

    monkeypatch.setattr(inductor.cpp, "cxx", (None, "no-such-compiler-here"))
    off, why = decode_compiled("auto", cpu, 10 * n, 64)
    assert not off and "no C++ compiler (no-such-compiler-here)" in why
    with pytest.raises(ValueError, match="auto, 0 or 1"):
        decode_compiled("yes", cpu, 1, 1)


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
