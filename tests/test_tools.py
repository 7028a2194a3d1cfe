"""Tool calls inside rollouts against nanochat's own Engine (tests/fixtures/nanochat-tool-use, made by nanochat
92d63d4): a checkpoint trained to call the calculator but to write a WRONG result itself, and the tokens and masks
nanochat's Engine produced from it, greedy. Ours, eager and compiled, must force the calculator's answer where
nanochat does, with the same tokens and masks."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import REPO
from nanochat_ext.engine import Engine
from nanochat_ext.loader import load_backbone, load_tokenizer_for
from nanochat_ext.sampling import SamplingConfig
from nanochat_ext.tools import ToolTokens
from test_engine import aot_eager  # noqa: F401  (a fixture)

TOOL_USE = REPO / "tests" / "fixtures" / "nanochat-tool-use"
GOLDEN = torch.load(TOOL_USE / "golden.pt", weights_only=True)


@pytest.fixture(scope="module")
def policy():
    bb = load_backbone(TOOL_USE / "chatsft_checkpoints" / "d2")
    tok = load_tokenizer_for(bb, str(TOOL_USE / "tokenizer"))
    return bb, tok


def generate(engine: Engine, tok, prompts: list[list[int]], max_new: int, group: int = 2):
    gens = [torch.Generator().manual_seed(0) for _ in prompts]
    return engine.generate(prompts, group, SamplingConfig(max_new, 0.0), tok.eos_id, tok.pad_id, gens)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_engine_forces_the_calculators_answer_as_nanochats_engine(policy, compiled, aot_eager):  # noqa: F811
    """All four prompts in one batch (ragged: left-padded to the longest), two samples each: every row's tokens and
    masks are nanochat's Engine's (its stream: the terminal <|assistant_end|> included): `3*4` forces 12 where the
    model would write 99, `1,200/4` forces 300.0, the refused `2**10` forces nothing, a string count forces 3."""
    bb, tok = policy
    tools = ToolTokens.of(tok)
    torch._dynamo.reset()
    prompts = [p["prompt_tokens"] for p in GOLDEN["prompts"]]
    got = generate(Engine(bb, compile=compiled, tools=tools), tok, prompts, GOLDEN["engine_kwargs"]["max_tokens"])
    want = [row for p in GOLDEN["prompts"] for row in p["stream_tokens"]]
    want_masks = [row for p in GOLDEN["prompts"] for row in p["stream_masks"]]
    assert got.completions == want
    assert got.sampled == want_masks
    assert sum(m.count(0) for m in got.sampled) == 2 * (4 + 7 + 0 + 3)  # every forced token, none elsewhere
    if compiled:
        assert not counters["graph_break"], dict(counters["graph_break"])


def test_forced_tokens_count_towards_max_new_tokens(policy):
    """nanochat stops a row mid-answer when max_tokens runs out (golden `truncated`): so do we."""
    bb, tok = policy
    t = GOLDEN["truncated"]
    got = generate(Engine(bb, tools=ToolTokens.of(tok)), tok, [GOLDEN["prompts"][0]["prompt_tokens"]],
                   t["kwargs"]["max_tokens"], group=1)
    assert got.completions == [t["completion_tokens"]] and got.sampled == [t["completion_masks"]]
    assert got.truncated == [True]


def test_without_tools_the_model_writes_its_own_results(policy):
    """--tools none: no block is answered and the model's own (wrong) results stand, as nanochat's own generate
    writes them; every token is sampled."""
    bb, tok = policy
    prompts = [p["prompt_tokens"] for p in GOLDEN["prompts"]]
    got = generate(Engine(bb), tok, prompts, GOLDEN["engine_kwargs"]["max_tokens"], group=1)
    assert got.sampled is None
    for completion, p in zip(got.completions, GOLDEN["prompts"]):
        assert completion == p["own_until_end"] + [tok.eos_id]
