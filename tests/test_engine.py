"""The rollout engine: compiled decoding over kept static state samples what eager decoding and a full re-forward
give (nanochat's golden vintages, the native Llama, ragged prompts, stop tokens); its state and graphs are made
once per batch shape; the sampler compiles at a real vocabulary; a bf16 run decodes from a bf16 copy of the
matmul weights with autocast's own tokens."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_nanochat_vintages import FIXTURES, fixture_dir, vintage_of
from test_sampling import assert_sampled_from_reforward, is_tie
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from nanochat_ext.engine import runner, scheduler
from nanochat_ext.engine.cost import COMPILE_PAYS_AFTER, COMPILE_PAYS_AFTER_CUDA, decode_compiled
from nanochat_ext.engine.engine import Engine
from nanochat_ext.engine.packed import PackedLinear, packs
from nanochat_ext.engine.sampling import SamplingConfig, cumsum_in_chunks, filter_logits, sample_token
from nanochat_ext.models.backbone import hold_frozen_in, matmul_params
from nanochat_ext.models.compiled import allow_recompiles, compile_blocks, compile_stats
from nanochat_ext.models.loader import load_backbone
from nanochat_ext.tasks.synthetic import make_tiny_gpt

PROMPTS = [list(range(5, 29)), list(range(7, 12)), list(range(40, 55))]  # ragged: left padding in play


def seeds(n: int = 3) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(i) for i in range(n)]


def greedy_stop(bb, cfg: SamplingConfig) -> int:
    """A stop token row 0 picks 4th when nothing stops it: rows then stop at different steps (the others go on,
    pads after a stop) and the ban before min_new_tokens is exercised."""
    return Engine(bb).generate(PROMPTS, 1, cfg, (), 0, seeds()).completions[0][3]


def assert_same_but_a_tie(got, want) -> None:
    """The same samples, but that one completion may part from the other at a tie (a uniform within ~1e-7 of a
    CDF boundary, where the static cache's masked attention and eager's round apart; each side's tokens are
    checked against a re-forward, tie-aware, by the callers). A wrong engine parts in most completions."""
    assert len(got.completions) == len(want.completions)
    parted = [i for i, (a, b) in enumerate(zip(got.completions, want.completions)) if a != b]
    assert len(parted) <= 1, parted


@pytest.fixture
def aot_eager(monkeypatch):
    """The engine's step compiled through dynamo and AOT autograd without inductor's code generation: the same
    captured graph, guards and static state, seconds instead of a C++ compile per model."""
    allow_recompiles()  # as compile_for does
    monkeypatch.setattr(runner, "compile_for",
                        lambda fn, device: torch.compile(fn, backend="aot_eager", dynamic=False))


@pytest.mark.parametrize("name", [*FIXTURES, "llama"])
def test_compiled_engine_samples_eagers_tokens_for_every_vintage(assets, name, aot_eager):
    """Every nanochat vintage (smear, value embeddings, windows as each commit had them) and the native Llama: the
    compiled step over the kept state takes eager's tokens, and each is what a re-forward gives (or a tie)."""
    bb = load_backbone(assets["hf"] if name == "llama" else fixture_dir(name),
                       vintage=None if name == "llama" else vintage_of(name))
    cfg = SamplingConfig(12, 1.0, min_new_tokens=3)
    stop = greedy_stop(bb, SamplingConfig(12, 0.0, min_new_tokens=3))
    eager, graphs = Engine(bb).generate(PROMPTS, 3, cfg, stop, 0, seeds()), compile_stats()[0]
    torch._dynamo.reset()  # compiled here: a graph of its own, not one another vintage left in the cache
    compiled = Engine(bb, compile=True).generate(PROMPTS, 3, cfg, stop, 0, seeds())
    assert compile_stats()[0] > graphs
    assert_same_but_a_tie(compiled, eager)
    assert_sampled_from_reforward(bb, PROMPTS, 3, cfg, stop, seeds(), compiled)
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("compile", [False, True])
def test_checking_for_the_end_every_few_steps_samples_the_same(compile, aot_eager, monkeypatch):
    """end_check_every=8 (the default but for eager decoding on CPU, #42 item 4): the host reads whether every row
    stopped at one step in 8, the rows that stopped take pads meanwhile, and the samples are those of a read every step,
    eager and compiled. Ragged prompts whose rows stop at different steps (greedy, a stop token each row reaches before
    the last token)."""
    bb = load_backbone(fixture_dir("current"), vintage=vintage_of("current"))
    cfg = SamplingConfig(40, 0.0)
    free = Engine(bb).generate(PROMPTS, 1, cfg, -1, 0, seeds()).completions
    stop = min(set.intersection(*map(set, free)), key=lambda tok: max(c.index(tok) for c in free))
    last = max(c.index(stop) for c in free)  # the step after which every row has stopped
    assert 1 <= last < 30
    reads = [0]
    for read in ("__bool__", "__int__"):  # a read of the device by the host, whichever way it is made
        real = getattr(torch.Tensor, read)
        monkeypatch.setattr(torch.Tensor, read, lambda t, real=real: reads.__setitem__(0, reads[0] + 1) or real(t))
    runs = {}
    for every in (1, 8):
        engine, reads[0] = Engine(bb, compile=compile, end_check_every=every, drop_finished=False), 0
        runs[every] = engine.generate(PROMPTS, 1, cfg, stop, 0, seeds()), engine.last.steps, reads[0]
    (each, each_steps, each_reads), (few, few_steps, few_reads) = runs[1], runs[8]
    assert few.completions == each.completions and few.truncated == each.truncated == [False] * 3
    read_at = -(-(last + 1) // 8) * 8 - 1  # the token after which the every-8 engine reads that all have stopped
    assert (each_steps, few_steps) == (last + compile, read_at + compile)  # decoded on, pads, to that read
    assert few_reads == each_reads - last + read_at // 8  # reads after tokens 0..last against 7, 15, .., read_at


@pytest.mark.parametrize("name,native", [("gpt_modern", True), ("hf", True), ("hf", False)])
def test_eager_decoding_drops_the_rows_that_stopped_and_samples_the_same(assets, name, native):
    """#67 item 2, eager: once a quarter of the rows have stopped, decoding goes on with the live rows alone (their
    cache, logits, uniforms and mask; nanochat's GPT, the native Llama and a transformers module's DynamicCache):
    fewer row-steps decoded, and every completion is what a full re-forward samples (or a tie) and what the engine
    samples keeping every row to the end. Ragged prompts, samples at temperature 1 whose rows stop at many steps."""
    bb = load_backbone(assets[name], native=native)
    cfg = SamplingConfig(24, 1.0)
    free = Engine(bb).generate(PROMPTS, 4, cfg, (), 0, seeds()).completions
    stops = [free[i][2 + 3 * i] for i in range(6)]  # rows 0-5 stop by steps 2, 5, .., 17; the others as they meet one
    runs = {}
    for drop in (False, True):
        engine = Engine(bb, drop_finished=drop)
        runs[drop] = engine.generate(PROMPTS, 4, cfg, stops, 0, seeds()), engine.last
    (kept, kept_stats), (dropped, dropped_stats) = runs[False], runs[True]
    assert 0 < sum(kept.truncated) <= 6 and kept_stats.row_steps == 12 * kept_stats.steps
    assert dropped_stats.row_steps < kept_stats.row_steps and dropped_stats.steps == kept_stats.steps
    assert_same_but_a_tie(dropped, kept)
    assert_sampled_from_reforward(bb, PROMPTS, 4, cfg, stops, seeds(), dropped)


@pytest.mark.parametrize("name", ["gpt_modern", "hf"])
def test_compiled_decoding_moves_the_live_rows_into_smaller_states(assets, name, aot_eager, monkeypatch):
    """#67 item 2, compiled: at a read of how many rows stopped, the live rows move into a kept state of half the
    rows while they fit in it (here down to 2 rows, COMPACT_MIN_ROWS lowered for a batch this small), cache, logits,
    uniforms and mask with them; fewer row-steps, and every completion and log-prob is what the compiled engine
    keeping every row samples (or a tie), and a re-forward's. nanochat's GPT and the native Llama, 16 rows stopping at
    many steps, a read every 4 steps."""
    monkeypatch.setattr(scheduler, "COMPACT_MIN_ROWS", 2)
    bb = load_backbone(assets[name])
    prompts = [*PROMPTS, list(range(60, 70))]
    cfg = SamplingConfig(24, 1.0)
    free = Engine(bb).generate(prompts, 4, cfg, (), 0, seeds(4)).completions
    stops = [free[i][1 + i] for i in range(12)]  # rows 0-11 stop by steps 1..12; the others as they meet one
    torch._dynamo.reset()
    runs = {}
    for drop in (False, True):
        engine = Engine(bb, compile=True, drop_finished=drop, end_check_every=4, logprobs=True)
        runs[drop] = engine.generate(prompts, 4, cfg, stops, 0, seeds(4)), engine.last, sorted(engine.states)
    (kept, kept_stats, kept_states), (dropped, dropped_stats, dropped_states) = runs[False], runs[True]
    halvings = [16 >> k for k in range(len(dropped_states))][::-1]  # each compaction into half the rows
    assert kept_states == [16] and dropped_states == halvings and len(halvings) >= 3, dropped_states
    assert set(dropped_states) <= set(engine.kept_rows([16])) == {2, 4, 8, 16}  # what the memory model counts
    assert kept_stats.row_steps == 16 * kept_stats.steps and dropped_stats.row_steps < 0.7 * kept_stats.row_steps
    assert_same_but_a_tie(dropped, kept)
    same = [i for i, (a, b) in enumerate(zip(kept.completions, dropped.completions)) if a == b]
    for i in same:
        torch.testing.assert_close(torch.tensor(dropped.logprobs[i]), torch.tensor(kept.logprobs[i]))
    assert_sampled_from_reforward(bb, prompts, 4, cfg, stops, seeds(4), dropped)


@pytest.mark.parametrize("name,native,compile", [("gpt_modern", True, False), ("gpt_modern", True, True),
                                                 ("hf", True, True), ("hf", False, False)])
def test_the_engine_keeps_each_tokens_log_prob_as_a_re_forward_gives_it(assets, name, native, compile, aot_eager):
    """#68 item 3: Engine(logprobs=True) returns every sampled token's log-prob under softmax(logits / T), before the
    sampler's top-k, top-p and held-back stops, as torch.log_softmax gives it over a full re-forward of that
    completion (the trainer's log-probs: the ratio to them is 1 but for rounding); eager with the stopped rows
    dropped, compiled, and a transformers module. Ragged prompts, rows stopping at different steps."""
    bb = load_backbone(assets[name], native=native)
    cfg = SamplingConfig(16, 0.8, top_k=20, top_p=0.9, min_new_tokens=2)
    free = Engine(bb).generate(PROMPTS, 3, cfg, (), 0, seeds()).completions
    stops = [free[i][3 + 2 * i] for i in range(4)]
    engine = Engine(bb, compile=compile, logprobs=True)
    got = engine.generate(PROMPTS, 3, cfg, stops, 0, seeds())
    assert got.logprobs is not None and sum(got.truncated) < 9  # rows stopped, at different steps
    assert Engine(bb, compile=compile).generate(PROMPTS, 3, cfg, stops, 0, seeds()).logprobs is None
    for i, (completion, logprobs) in enumerate(zip(got.completions, got.logprobs, strict=True)):
        prompt = PROMPTS[i // 3]
        with torch.no_grad():
            logits = bb(torch.tensor([prompt + completion[:-1]]))[0, len(prompt) - 1:].float()
        want = torch.log_softmax(logits / cfg.temperature, dim=-1).gather(1, torch.tensor(completion)[:, None])
        torch.testing.assert_close(torch.tensor(logprobs), want.squeeze(1), atol=1e-4, rtol=0)


def test_chunked_cumsum_is_torchs_cumsum_at_any_length():
    """Vocabularies below, at and above a chunk, GPT-2's, above 65536 (a second level of chunks) and Qwen's."""
    for n in (1, 255, 256, 257, 50257, 65537, 151936):
        x = torch.rand(3, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
        torch.testing.assert_close(cumsum_in_chunks(x), x.cumsum(-1), rtol=1e-12, atol=1e-9, msg=str(n))


def warped_by_transformers(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """transformers' own logits warpers, in the order its generate applies them: temperature, top-k, top-p."""
    scores = TemperatureLogitsWarper(cfg.temperature)(None, logits)
    if cfg.top_k:
        scores = TopKLogitsWarper(cfg.top_k)(None, scores)
    return TopPLogitsWarper(cfg.top_p)(None, scores) if cfg.top_p < 1 else scores


def flat_inverse_cdf(logits: torch.Tensor, u: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Inverse-CDF sampling in float64 over transformers' filtered distribution (torch's own cumsum over the whole
    vocabulary): the oracle the chunked sampler must agree with but for ties."""
    probs = torch.softmax(warped_by_transformers(logits.double(), cfg), dim=-1)
    cdf = probs.cumsum(-1)
    return torch.searchsorted(cdf, (u.double() * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)


def test_sampler_compiles_at_a_real_vocabulary():
    """At vocab 65536 (where inductor's CUDA scan once crashed) the sampler compiles (inductor, CPU) and takes
    eager's tokens, and both are the whole-vocabulary inverse CDF's (float64) over what transformers' own top-k and
    top-p warpers keep, but for ties; our filters keep exactly their tokens; no token removed by top-k / top-p or of
    probability 0 is ever taken, u near 1 included."""
    g = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(16, 65536, generator=g)
    logits[:, -3000:] = float("-inf")  # a tail of probability 0 (as vocabulary padding is)
    u = torch.rand(16, generator=g)
    u[:2] = torch.tensor([0.0, 1 - 2 ** -24])
    cfg = SamplingConfig(temperature=0.8, top_k=50, top_p=0.9)  # every filter and both chunked scans
    compiled = torch.compile(sample_token, dynamic=False)(logits, u, cfg)
    eager = sample_token(logits, u, cfg)
    want = flat_inverse_cdf(logits, u, cfg)
    kept = torch.isfinite(warped_by_transformers(logits, cfg))
    assert torch.equal(torch.isfinite(filter_logits(logits, cfg)), kept) and kept.sum(-1).lt(50).any()  # top-p acts
    for tokens in (compiled, eager):
        assert kept.gather(1, tokens[:, None]).all()
        for i in range(16):
            assert tokens[i] == want[i] or is_tie(logits[i:i + 1], u[i:i + 1], int(tokens[i]), cfg), i
    assert torch.equal(compiled, eager) or all(
        is_tie(logits[i:i + 1], u[i:i + 1], int(compiled[i]), cfg) for i in torch.nonzero(compiled != eager)[:, 0])


@pytest.mark.parametrize("name", ["gpt_modern", "hf"])
def test_bf16_decoding_reads_a_bf16_copy_with_autocasts_tokens(assets, name, monkeypatch):
    """Under bf16 autocast the engine decodes from a copy holding the matmul weights in bf16 (embeddings, norms and
    scalars are the policy's own tensors, not copies): its logits are bitwise those of the fp32 masters under
    autocast (which casts them to the same bf16 at every matmul), so are its tokens, and a change to the masters
    reaches the copy at the next call."""
    bb = load_backbone(assets[name])
    compile_blocks(bb, backend="eager")  # --compile's blocks: the copy must run its own weights, not these
    engine = Engine(bb)
    cfg = SamplingConfig(10, 1.0)
    ids = torch.tensor([[5, 17, 42, 99, 7, 3], [3, 250, 8, 9, 10, 11]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        lowered = engine._decoder(torch.device("cpu"))
        assert lowered is not bb and all(p.dtype == torch.bfloat16 for p in matmul_params(lowered))
        assert not any("forward" in m.__dict__ for m in lowered.modules())
        assert all(p.dtype == torch.float32 for p in matmul_params(bb))
        shared = [n for n, p in lowered.named_parameters() if p.dtype == torch.float32]
        assert shared and all(p is dict(bb.named_parameters())[n] for n, p in lowered.named_parameters() if n in shared)
        assert torch.equal(lowered.prefill(ids, None, 8)[0], bb.prefill(ids, None, 8)[0])
        got = engine.generate(PROMPTS, 2, cfg, 1, 0, seeds())
        monkeypatch.setattr(Engine, "_decoder", lambda self, device: self.model)  # autocast on the masters
        assert got == Engine(bb).generate(PROMPTS, 2, cfg, 1, 0, seeds())
        monkeypatch.undo()
    with torch.no_grad():  # outside autocast, whose cache of cast weights lasts as long as its context
        for p in matmul_params(bb):
            p.mul_(1.5)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(engine._decoder(torch.device("cpu")).prefill(ids, None, 8)[0], bb.prefill(ids, None, 8)[0])
    stats = engine.last
    assert stats.weight_bytes == sum(p.numel() * 2 for p in matmul_params(bb)) and stats.steps > 0


def test_compile_auto_compiles_where_the_compile_pays_back():
    """--compile auto: compiled on CPU for a run that decodes COMPILE_PAYS_AFTER token steps or more, with
    a C++ compiler for inductor, and on CUDA from COMPILE_PAYS_AFTER_CUDA; eager for shorter runs (the demo's
    200 x 16), without a compiler, and on another device. 0 and 1 are obeyed as given."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    n = -(-COMPILE_PAYS_AFTER // 64)  # the fewest steps of 64 tokens that reach it
    assert decode_compiled("auto", cpu, n, 64)[0] and not decode_compiled("auto", cpu, n - 1, 64)[0]
    off, why = decode_compiled("auto", cpu, 200, 16)
    assert not off and "3200 token steps" in why
    m = -(-COMPILE_PAYS_AFTER_CUDA // 64)
    assert decode_compiled("auto", cuda, m, 64)[0] and not decode_compiled("auto", cuda, m - 1, 64)[0]
    assert not decode_compiled("auto", torch.device("mps"), 10 * n, 64)[0]
    assert decode_compiled("1", cuda, 1, 1)[0] and not decode_compiled("0", cpu, 10 * n, 64)[0]
    from torch._inductor import config as inductor

    # torch's own patch: a monkeypatch of this config entry deletes it on undo, breaking every later compile
    with inductor.patch({"cpp.cxx": (None, "no-such-compiler-here")}):
        off, why = decode_compiled("auto", cpu, 10 * n, 64)
    assert not off and "no C++ compiler (no-such-compiler-here)" in why
    with pytest.raises(ValueError, match="auto, 0 or 1"):
        decode_compiled("yes", cpu, 1, 1)


@pytest.mark.parametrize("name", ["feb2026", "current"])
def test_static_cache_takes_bf16_autocast_values_on_value_embedding_vintages(name, monkeypatch):
    """Under bf16 autocast a value embedding (fp32) promotes v to fp32, which the static decode path writes into
    its bf16 cache: in the cache's dtype, so the step runs uncompiled (it raised before) and compiled (aot_eager:
    the same ops, the same tokens). Against the eager engine only the first token is compared: bf16 attention
    over the whole static cache and over the grown one round apart by ~1e-2, which moves later samples."""
    bb = load_backbone(fixture_dir(name), vintage=vintage_of(name))
    cfg = SamplingConfig(8, 1.0)
    with torch.autocast("cpu", torch.bfloat16):
        eager = Engine(bb).generate(PROMPTS, 2, cfg, -1, 0, seeds())
        monkeypatch.setattr(runner, "compile_for", lambda fn, device: fn)  # the static step, uncompiled
        static = Engine(bb, compile=True).generate(PROMPTS, 2, cfg, -1, 0, seeds())
        torch._dynamo.reset()
        monkeypatch.setattr(runner, "compile_for",
                            lambda fn, device: torch.compile(fn, backend="aot_eager", dynamic=False))
        compiled = Engine(bb, compile=True).generate(PROMPTS, 2, cfg, -1, 0, seeds())
    assert static == compiled
    assert [c[0] for c in static.completions] == [c[0] for c in eager.completions]


def test_a_packed_linear_is_torchs_linear_up_to_rounding_row_by_row():
    """The oracle is torch's own F.linear: the packed layer (oneDNN's GEMM over the weight packed once) gives its
    output to fp32 rounding on ragged row counts and a 3-d input, with and without a bias, each row's output its own
    input's alone (the rows a batch holds change none)."""
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 40, generator=g), torch.randn(96, generator=g)
    for b in (None, bias):
        layer = PackedLinear(weight, b)
        layer.pack(8)
        for shape in [(1, 40), (3, 40), (8, 40), (2, 5, 40)]:
            x = torch.randn(*shape, generator=g)
            got, want = layer(x), F.linear(x, weight, b)
            assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
            assert torch.equal(layer(x[:1]), got[:1])


@pytest.mark.parametrize("name", ["gpt_modern", "hf"])
def test_decoding_from_packed_weights_takes_the_plain_engines_tokens_and_follows_the_policy(assets, name, aot_eager):
    """An engine that packs (forced here: packed.packs leaves the tests' small models plain) samples the plain
    engine's tokens, each what a re-forward gives, eager and compiled alike (the compiled step calls the same packed
    op); after the policy moves, the next call repacks and decodes from the new weights, with no new graph."""
    bb = load_backbone(assets[name])
    cfg = SamplingConfig(10, 1.0)
    plain = Engine(bb, pack=False).generate(PROMPTS, 2, cfg, (), 0, seeds())
    packed_eager, packed_compiled = Engine(bb, pack=True), Engine(bb, compile=True, reserve=40, pack=True)
    for engine in (packed_eager, packed_compiled):
        got = engine.generate(PROMPTS, 2, cfg, (), 0, seeds())
        assert_same_but_a_tie(got, plain)
        assert_sampled_from_reforward(bb, PROMPTS, 2, cfg, (), seeds(), got)
        assert engine._packed.packed_bytes() == 0  # the packed weights lived through the call only
    graphs = compile_stats()[0]
    with torch.no_grad():
        for p in matmul_params(bb):
            p.mul_(-1.3)
    moved = Engine(bb, pack=False).generate(PROMPTS, 2, cfg, (), 0, seeds())
    assert moved.completions != plain.completions
    for engine in (packed_eager, packed_compiled):
        assert_same_but_a_tie(engine.generate(PROMPTS, 2, cfg, (), 0, seeds()), moved)
    assert compile_stats()[0] == graphs


def test_weights_are_packed_where_a_step_streams_them_from_memory(tmp_path):
    """packed.packs: a CPU step over fp32 weights of PACK_FROM_BYTES or more (SmolLM2-135M's 538 MB) packs; the tests'
    small models, a bf16 copy and a GPU decode from plain weights."""
    big = load_backbone(make_tiny_gpt(tmp_path / "big", 512, n_layer=4, n_embd=512, n_head=4, n_kv_head=4))
    small = load_backbone(make_tiny_gpt(tmp_path / "small", 512))
    cpu = torch.device("cpu")
    assert packs(big, cpu) and not packs(small, cpu) and not packs(big, torch.device("cuda"))
    assert not packs(hold_frozen_in(big.requires_grad_(False), torch.bfloat16), cpu)
    assert Engine(small)._packed_over(small, 8, cpu) is small


def test_the_packed_copy_runs_its_own_packed_layers_of_a_compiled_tied_llama(tmp_path, monkeypatch):
    """SmolLM2's case: a native Llama whose LM head is its embedding, its blocks compiled (--compile's forward on each
    block instance calls the original block): the packed copy runs its own layers, every linear one and the tied
    head packed at every step, the tokens the plain engine's; the step's bytes count the head (the embedding, read
    whole by the logits), as they do for the plain engine."""
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                 tie_word_embeddings=True)).save_pretrained(tmp_path / "tied")
    bb = load_backbone(tmp_path / "tied")
    assert bb.model.lm_head is None
    compile_blocks(bb, backend="eager")
    calls = []
    forward = PackedLinear.forward
    monkeypatch.setattr(PackedLinear, "forward", lambda self, x: calls.append(self) or forward(self, x))
    cfg = SamplingConfig(6, 1.0)
    engine = Engine(bb, pack=True, drop_finished=False)
    got = engine.generate(PROMPTS, 2, cfg, (), 0, seeds())
    layers = 2 * 4 + 1  # qkv, o, gate/up, down a block, and the head
    assert len(calls) == layers * 6 and len(set(map(id, calls))) == layers  # the prefill and 5 decode steps
    assert_same_but_a_tie(got, Engine(bb, pack=False).generate(PROMPTS, 2, cfg, (), 0, seeds()))
    head = bb.model.embed.weight.numel() * 4
    assert engine.last.weight_bytes == sum(p.numel() * 4 for p in matmul_params(bb)) + head
