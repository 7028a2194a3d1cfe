"""The engine's weights packed for MKL (decode_weights.py) against torch's own linear: the same logits and tokens as the
plain weights, eager and compiled, packed anew after the weights change in place (as an optimizer step changes them)
and for another row count, and no new graph for the new packing."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from nanochat_ext import synthetic
from nanochat_ext.compiled import compile_stats
from nanochat_ext.decode_weights import PackedLinear, packing_pays
from nanochat_ext.engine import Engine
from nanochat_ext.loader import load_backbone
from nanochat_ext.sampling import SamplingConfig
from test_engine import PROMPTS, aot_eager, assert_same_but_a_tie, seeds  # noqa: F401 (aot_eager: a fixture)
from test_sampling import assert_sampled_from_reforward

pytestmark = pytest.mark.skipif(not packing_pays(torch.device("cpu"), torch.float32), reason="this torch has no MKL")


def load(assets, tmp_path, name: str):
    if name == "hf_tied":  # SmolLM2's LM head: the embedding, packed as a head of its own
        return load_backbone(synthetic.make_tiny_hf_llama(tmp_path / "tied", tied=True))
    return load_backbone(assets[name])


@pytest.mark.parametrize("name", ["gpt_modern", "hf", "hf_tied"])
def test_packed_weights_decode_the_plain_weights_tokens(assets, tmp_path, name):
    """Ragged prompts, sampled: the packed engine's tokens are those of an engine on the plain weights (or part at a
    tie), each a re-forward's; its logits at the packed row count are torch's linear's to rounding. After the masters
    change in place the next call packs anew and still matches; a call that changes nothing packs nothing."""
    bb = load(assets, tmp_path, name)
    packed, plain = Engine(bb), Engine(bb, pack=False)
    cfg = SamplingConfig(12, 1.0)
    one_token_rows = torch.tensor([[5], [17], [42], [99], [7], [3], [250], [8], [9]])  # 9 rows: the packed count
    for _ in range(2):
        got = packed.generate(PROMPTS, 3, cfg, 1, 0, seeds())
        decoder = packed._packed[1]
        layers = [m for m in decoder.modules() if isinstance(m, PackedLinear)]
        assert len(layers) == sum(isinstance(m, torch.nn.Linear) for m in bb.modules()) + (name == "hf_tied")
        assert all(m.rows == 9 for m in layers)
        assert_same_but_a_tie(got, plain.generate(PROMPTS, 3, cfg, 1, 0, seeds()))
        assert_sampled_from_reforward(bb, PROMPTS, 3, cfg, 1, seeds(), got)
        with torch.no_grad():
            torch.testing.assert_close(decoder.prefill(one_token_rows, None, 2)[0],
                                       bb.prefill(one_token_rows, None, 2)[0], rtol=1e-5, atol=1e-5)
            held = [m.packed for m in layers]
            packed.generate(PROMPTS, 3, cfg, 1, 0, seeds())
            assert all(m.packed is h for m, h in zip(layers, held))  # unchanged weights: not packed again
            for p in bb.parameters():
                p.mul_(1.25)  # in place, as an optimizer step
    packed.generate(PROMPTS[:2], 2, cfg, 1, 0, seeds(2))
    assert all(m.rows == 4 for m in layers)


def test_compiled_packed_decoding_adds_no_graph_when_the_weights_change(assets, aot_eager):
    """The compiled step calls the packed op as it is (no graph break); new packings of changed weights are new
    tensors in the same places, so a second call adds no graph and takes the plain engine's tokens."""
    bb = load_backbone(assets["hf"])
    cfg = SamplingConfig(10, 1.0)
    torch._dynamo.reset()
    engine = Engine(bb, compile=True)
    engine.generate(PROMPTS, 2, cfg, 1, 0, seeds())
    graphs = compile_stats()[0]
    assert engine._packed is not None and graphs > 0
    with torch.no_grad():
        for p in bb.parameters():
            p.mul_(0.8)
    got = engine.generate(PROMPTS, 2, cfg, 1, 0, seeds())
    assert compile_stats()[0] == graphs and not counters["graph_break"], dict(counters["graph_break"])
    assert_same_but_a_tie(got, Engine(bb, pack=False).generate(PROMPTS, 2, cfg, 1, 0, seeds()))
    assert_sampled_from_reforward(bb, PROMPTS, 2, cfg, 1, seeds(), got)
