"""engine/runner.py's compiled runner: its decode state kept between calls (the same buffers at the same addresses, no
new graph for a batch of the same shape), made long enough for the run's reserve or grown for a longer call, and its
steps reading the cache in use by length buckets; the tokens eager's and a re-forward's throughout. The runners
against each other and every model: test_engine.py."""
from __future__ import annotations

import pytest
import torch
from test_engine import PROMPTS, aot_eager, assert_same_but_a_tie, greedy_stop, seeds  # noqa: F401 (a fixture)
from test_nanochat_vintages import fixture_dir, vintage_of
from test_sampling import assert_sampled_from_reforward
from torch._dynamo.utils import counters

from nanochat_ext.engine import runner, scheduler
from nanochat_ext.engine.engine import Engine
from nanochat_ext.engine.sampling import SamplingConfig
from nanochat_ext.models.compiled import allow_recompiles, compile_stats
from nanochat_ext.models.loader import load_backbone


@pytest.mark.parametrize("name,temperature", [("gpt_modern", 0.0)])
def test_inductor_engine_keeps_its_state_and_graph(assets, name, temperature):
    """--compile 1 with inductor on today's nanochat, greedy, rows stopping at different steps (the native Llama and
    sampling run compiled in test_engine's aot_eager tests, whose graphs are the same before code generation). The
    compiled tokens are eager's, each a re-forward's; a second call of the same batch shape reuses the state (the
    same data_ptr for every buffer, each marked a static address for CUDA graphs) and adds no graph. (That another row
    count gets a state of its own is engine logic whatever the backend: test_grpo's
    test_the_memory_model_counts_the_decode_states_a_compiled_evaluation_keeps holds it, under aot_eager; here it was
    a second inductor compile of the decode step: 24.9 -> 21.1 s of CPU for this test.)"""
    bb = load_backbone(assets[name])
    torch._dynamo.reset()  # compiled here, whatever earlier tests compiled
    cfg = SamplingConfig(20, temperature, min_new_tokens=3)
    stop = greedy_stop(bb, SamplingConfig(20, 0.0, min_new_tokens=3)) if not temperature else 1
    eager = Engine(bb).generate(PROMPTS, 3, cfg, stop, 0, seeds())
    engine = Engine(bb, compile=True)
    first = engine.generate(PROMPTS, 3, cfg, stop, 0, seeds())
    state, graphs = engine.states[9], compile_stats()[0]
    pointers = [t.data_ptr() for t in state.tensors()]
    assert graphs > 0 and all(t._dynamo_static_input_type for t in state.tensors())
    second = engine.generate([p[1:] for p in PROMPTS], 3, cfg, stop, 0, seeds())  # shorter: the same bucket
    assert engine.states[9] is state and [t.data_ptr() for t in state.tensors()] == pointers
    assert compile_stats()[0] == graphs and not counters["graph_break"], dict(counters["graph_break"])
    for got in (first, eager):
        assert_sampled_from_reforward(bb, PROMPTS, 3, cfg, stop, seeds(), got)
    assert_sampled_from_reforward(bb, [p[1:] for p in PROMPTS], 3, cfg, stop, seeds(), second)
    if not temperature:
        assert len(eager.completions[0]) == 4 and True in eager.truncated and first == eager


@pytest.mark.parametrize("name", ["current-d4", "llama"])
def test_compiled_steps_read_the_cache_in_use_by_length_buckets(assets, name, monkeypatch):
    """#67 item 1: a compiled step reads the cache slots in use rounded up to a length bucket (READ_BUCKET, here 32
    for a model this small, doubling), not the whole allocation: a graph per bucket, each reading its bucket's
    slots, the last the whole cache; the tokens are eager's and a re-forward's (or a tie), across the bucket
    boundary and a sliding window's edge (nanochat's current-d4: three layers of a 128-token window; the native
    Llama); a second call of other prompt lengths in the same buckets adds no graph."""
    monkeypatch.setattr(scheduler, "READ_BUCKET", 32)
    read = []  # per graph compiled: the keys' lengths its attention reads (SDPA's key argument in the captured graph)

    def recording(gm: torch.fx.GraphModule, example_inputs):
        read.append({node.args[1].meta["example_value"].size(2) for node in gm.graph.nodes
                     if node.target is torch.nn.functional.scaled_dot_product_attention})
        return gm.forward  # the captured graph, run as it is

    allow_recompiles()  # as compile_for does
    monkeypatch.setattr(runner, "compile_for", lambda fn, device: torch.compile(fn, backend=recording,
                                                                                       dynamic=False))
    bb = load_backbone(assets["hf"] if name == "llama" else fixture_dir(name),
                       vintage=None if name == "llama" else vintage_of(name))
    prompts = [list(range(3, 3 + 115)), list(range(5, 5 + 90)), list(range(7, 7 + 100))]  # ragged: left padding
    cfg = SamplingConfig(40, 1.0)  # slots 116..155 in use, of a 192-slot cache: 128 read, then all 192
    torch._dynamo.reset()
    engine, before = Engine(bb, compile=True, drop_finished=False), compile_stats()[0]
    got = engine.generate(prompts, 2, cfg, (), 0, seeds())
    slots, graphs = engine.states[6].slots, compile_stats()[0]
    assert slots == 192 and read == [{128}, {192}] and graphs == before + 2, (slots, read, graphs - before)
    assert_same_but_a_tie(got, Engine(bb).generate(prompts, 2, cfg, (), 0, seeds()))
    assert_sampled_from_reforward(bb, prompts, 2, cfg, (), seeds(), got)
    shorter = [p[4:] for p in prompts]
    again = engine.generate(shorter, 2, cfg, (), 0, seeds())
    assert compile_stats()[0] == graphs and len(read) == 2 and not counters["graph_break"], \
        dict(counters["graph_break"])
    assert_sampled_from_reforward(bb, shorter, 2, cfg, (), seeds(), again)


def test_a_reserved_state_serves_every_prompt_length_of_the_run(assets, aot_eager):
    """Engine(reserve=the run's longest prompt + new tokens), as GRPO makes it: a later, longer batch reuses the state
    (the same buffers at the same addresses) and adds no graph, where an unreserved engine rebuilds and recompiles."""
    bb = load_backbone(assets["gpt_modern"])
    cfg = SamplingConfig(8, 1.0)
    long = [list(range(3, 3 + 70)), *PROMPTS[1:]]
    torch._dynamo.reset()
    engine = Engine(bb, compile=True, reserve=70 + 8)
    engine.generate(PROMPTS, 2, cfg, 1, 0, seeds())
    state, graphs = engine.states[6], compile_stats()[0]
    pointers = [t.data_ptr() for t in state.tensors()]
    got = engine.generate(long, 2, cfg, 1, 0, seeds())
    assert engine.states[6] is state and [t.data_ptr() for t in state.tensors()] == pointers
    assert compile_stats()[0] == graphs and state.slots == 2 * runner.SLOT_BUCKET
    assert_same_but_a_tie(got, Engine(bb).generate(long, 2, cfg, 1, 0, seeds()))


def test_compiled_state_grows_for_longer_prompts(assets, aot_eager):
    """A call that needs more cache slots than the kept state has gets a larger one (rounded up to SLOT_BUCKET),
    and the same tokens as eager."""
    bb = load_backbone(assets["gpt_modern"])
    cfg = SamplingConfig(8, 1.0)
    engine = Engine(bb, compile=True)
    engine.generate(PROMPTS, 2, cfg, 1, 0, seeds())
    assert engine.states[6].slots == runner.SLOT_BUCKET
    long = [list(range(3, 3 + 70)), *PROMPTS[1:]]
    got = engine.generate(long, 2, cfg, 1, 0, seeds())
    assert engine.states[6].slots == 2 * runner.SLOT_BUCKET
    assert_same_but_a_tie(got, Engine(bb).generate(long, 2, cfg, 1, 0, seeds()))
    assert_sampled_from_reforward(bb, long, 2, cfg, 1, seeds(), got)
