"""Every end of a turn stops a row (#48 item 3): the tokenizer's stop ids (nanochat's <|assistant_end|> and <|bos|>;
a Hugging Face tokenizer's eos and its generation config's eos_token_id), each ending a row in the engine, eager and
compiled, with tools and without, and the loss mask, the reward text and --min_new_tokens the same whichever stopped
it. A random tiny model takes a stop only by chance, so each test renames two tokens its greedy rows take at
different steps as the two stops (their embedding and LM head rows swapped with the stops'): the model is the same,
only the ids are renamed, so its rows are its free rows, renamed, cut after the first stop."""
from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from test_engine import aot_eager, seeds  # noqa: F401  (a fixture)
from test_sampling import assert_sampled_from_reforward
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from nanochat_ext.agent.agent import Agent, AgentConfig
from nanochat_ext.algorithms.rewards import Rewards
from nanochat_ext.data.rows import PromptRow
from nanochat_ext.engine.engine import Engine
from nanochat_ext.engine.sampling import SamplingConfig
from nanochat_ext.errors import InputError
from nanochat_ext.models.backbone import Backbone
from nanochat_ext.models.compiled import compile_stats
from nanochat_ext.models.loader import load_backbone, load_tokenizer_for
from nanochat_ext.models.reward_model import RewardModel, RewardScorer
from nanochat_ext.tokenizer import TokenizerWrapper
from nanochat_ext.training.logprobs import make_sequences

PROMPTS = [list(range(5, 29)), list(range(7, 12)), list(range(40, 55)), list(range(60, 70)), [90, 91, 92]]
MAX_NEW = 16
GREEDY = SamplingConfig(MAX_NEW, 0.0)


@pytest.fixture(scope="module")
def im_end_dir(assets, tmp_path_factory):
    """The tiny Hugging Face Llama with an <|im_end|> token its generation config ends turns with, apart from the
    tokenizer's eos (<|endoftext|>), as SmolLM2-Instruct's and Gemma's are."""
    d = tmp_path_factory.mktemp("im_end")
    tok = AutoTokenizer.from_pretrained(assets["hf"])
    tok.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    model = AutoModelForCausalLM.from_pretrained(assets["hf"])
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    GenerationConfig(eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def kinds(assets, im_end_dir) -> dict[str, tuple[Backbone, TokenizerWrapper]]:
    nanochat = load_backbone(assets["gpt"])
    hf = load_backbone(im_end_dir)
    return {"nanochat": (nanochat, load_tokenizer_for(nanochat, assets["tokenizer"])),
            "hf": (hf, load_tokenizer_for(hf, None))}


def relabelled(bb: Backbone, renames: dict[int, int]) -> Backbone:
    """bb with token a called b (and b called a) for each a -> b: their embedding and LM head rows swapped."""
    out = copy.deepcopy(bb)
    rows = out.model.lm_head.weight.size(0)
    with torch.no_grad():
        for p in out.parameters():
            if p.dim() == 2 and p.size(0) == rows:
                for a, b in renames.items():
                    p[[a, b]] = p[[b, a]]
    return out


def stopping_rows(bb: Backbone, tok: TokenizerWrapper, tools: Agent | None = None):
    """(model, want): bb with two tokens x, y its free greedy rows take renamed as the tokenizer's first two stop ids
    a, b (and a, b as x, y), chosen so that rows stop at different steps with different stops and another runs to
    max_new_tokens; want: each free row renamed, cut after its first stop, and whether it was truncated."""
    free = Engine(bb, agent=tools).generate(PROMPTS, 1, GREEDY, (), tok.pad_id, seeds(len(PROMPTS)))
    assert free.tool_calls == 0  # no calculator answer, which would not be renamed
    a, b = tok.stop_ids[:2]
    taken = {t for c in free.completions for t in c}
    candidates = sorted(taken - {t for p in PROMPTS for t in p} - {*tok.stop_ids, tok.pad_id, *tok._special.values()})
    for x in candidates:
        for y in (y for y in candidates if y != x):
            rename = {x: a, a: x, y: b, b: y}
            rows = [[rename.get(t, t) for t in c] for c in free.completions]
            ends = [next((k for k, t in enumerate(c) if t in (a, b)), None) for c in rows]
            stopped = [(k, rows[r][k]) for r, k in enumerate(ends) if k is not None]
            if (len({k for k, _ in stopped}) >= 2 and {t for _, t in stopped} == {a, b} and None in ends
                    and max(k for k, _ in stopped) >= 2):
                want = [(c if k is None else c[:k + 1], k is None) for c, k in zip(rows, ends)]
                return relabelled(bb, {x: a, y: b}), want
    raise AssertionError("no two tokens stop the free rows at different steps")


def test_each_tokenizer_kind_says_where_a_turn_ends(kinds, assets, im_end_dir, tmp_path):
    """nanochat: <|assistant_end|> and <|bos|>. Hugging Face: the eos and the generation config's eos_token_id (a
    list or an int), the model's own where the tokenizer comes from elsewhere, the model config's without one; a saved
    policy keeps it for the next stage; a bad one is one line naming the file and the field."""
    (_, nano), (hf_bb, hf) = kinds["nanochat"], kinds["hf"]
    assert nano.stop_ids == (nano.special("<|assistant_end|>"), nano.special("<|bos|>"))
    im_end = hf._impl.convert_tokens_to_ids("<|im_end|>")
    assert hf.stop_ids == (hf.eos_id, im_end) and im_end != hf.eos_id
    assert nano.describe_stops() == "stops: <|assistant_end|> (507), <|bos|> (503)"
    assert hf.describe_stops() == f"stops: <|endoftext|> (0), <|im_end|> (512) (eos and {hf.generation_config})"
    assert load_tokenizer_for(hf_bb, assets["hf"]).stop_ids == (hf.eos_id, im_end)  # the model's config, not its
    assert TokenizerWrapper.load(assets["hf"]).stop_ids == (hf.eos_id,)
    one = tmp_path / "one"
    shutil.copytree(im_end_dir, one)
    (one / "generation_config.json").write_text(json.dumps({"eos_token_id": im_end}))
    assert TokenizerWrapper.load(one).stop_ids == (hf.eos_id, im_end)
    (one / "generation_config.json").unlink()
    assert TokenizerWrapper.load(one).stop_ids == (hf.eos_id,)
    config = json.loads((one / "config.json").read_text())  # without a generation config: the model config's, as
    (one / "config.json").write_text(json.dumps({**config, "eos_token_id": [hf.eos_id, im_end]}))  # transformers
    assert TokenizerWrapper.load(one).stop_ids == (hf.eos_id, im_end)
    (one / "config.json").write_text(json.dumps(config))
    saved = hf_bb.save(tmp_path / "out", 3, {"step": 3}, hf)  # the native Llama writes its own config only
    assert load_tokenizer_for(load_backbone(saved), None).stop_ids == (hf.eos_id, im_end)
    (one / "generation_config.json").write_text(json.dumps({"eos_token_id": ["<|im_end|>"]}))
    with pytest.raises(InputError, match="generation_config.json: field 'eos_token_id': must be a token id"):
        TokenizerWrapper.load(one)
    (one / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 9999]}))
    with pytest.raises(InputError, match=r"field 'eos_token_id': stop ids \[9999\] are beyond the backbone's 513"):
        load_tokenizer_for(load_backbone(one), None)


@pytest.mark.parametrize("kind,compiled,with_tools", [
    ("nanochat", False, False), ("nanochat", False, True), ("nanochat", True, False), ("nanochat", True, True),
    ("hf", False, False), ("hf", True, False)])
def test_rows_stop_at_whichever_stop_they_take(kinds, kind, compiled, with_tools, aot_eager):  # noqa: F811
    """One batch: rows stop at different steps, some at one stop id and some at the other (nanochat's <|bos|> and
    <|assistant_end|>; <|endoftext|> and <|im_end|>), another runs to max_new_tokens; each keeps the stop it took as
    its last token. Eager and compiled (no graph break; another set of stop ids of the same size compiles nothing),
    with nanochat's tools on and off."""
    bb, tok = kinds[kind]
    tools = Agent(AgentConfig(tools="calculator"), tok) if with_tools else None
    model, want = stopping_rows(bb, tok, tools)
    torch._dynamo.reset()
    engine = Engine(model, compile=compiled, agent=tools)
    got = engine.generate(PROMPTS, 1, GREEDY, tok.stop_ids, tok.pad_id, seeds(len(PROMPTS)))
    assert list(zip(got.completions, got.truncated)) == want
    assert {c[-1] for c, t in want if not t} == set(tok.stop_ids[:2])
    assert_sampled_from_reforward(model, PROMPTS, 1, GREEDY, tok.stop_ids, seeds(len(PROMPTS)), got)
    if compiled:
        graphs = compile_stats()[0]
        swapped = engine.generate(PROMPTS, 1, GREEDY, tok.stop_ids[::-1], tok.pad_id, seeds(len(PROMPTS)))
        assert swapped == got and compile_stats()[0] == graphs
        assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("kind,compiled", [("nanochat", False), ("nanochat", True), ("hf", False)])
def test_min_new_tokens_holds_back_every_stop(kinds, kind, compiled, aot_eager):  # noqa: F811
    """--min_new_tokens past the steps where rows would stop at either stop id: no row takes any of them before,
    and every token is the one a re-forward gives with all of them held back."""
    bb, tok = kinds[kind]
    model, want = stopping_rows(bb, tok)
    cfg = SamplingConfig(MAX_NEW, 0.0, min_new_tokens=max(len(c) for c, t in want if not t))
    got = Engine(model, compile=compiled).generate(PROMPTS, 1, cfg, tok.stop_ids, tok.pad_id, seeds(len(PROMPTS)))
    assert all(not set(tok.stop_ids) & set(c[:cfg.min_new_tokens]) for c in got.completions)
    assert_sampled_from_reforward(model, PROMPTS, 1, cfg, tok.stop_ids, seeds(len(PROMPTS)), got)


@pytest.mark.parametrize("kind", ["nanochat", "hf"])
def test_the_loss_and_the_reward_see_the_same_whichever_stop_ended_a_row(kinds, kind):
    """The same rows, stopped where they stop with one stop id or with the other: the same completion but for its
    last token, the same loss mask (--mask_truncated's too), the same reward text (the reply without its stop,
    <|bos|> included) and the same reward model score (the reply ended as rendered replies end, with eos_id)."""
    bb, tok = kinds[kind]
    model, want = stopping_rows(bb, tok)
    a, b = tok.stop_ids[:2]
    other = relabelled(model, {a: b})  # every stop a now b and b now a
    rm = RewardModel(bb)
    rm.init_head(0)
    rewards = Rewards(RewardScorer(rm, tok, 256, {}), ["rewards_for_tests:text_length"], None)
    rows = [PromptRow([{"role": "user", "content": "hi"}], "p", {}, i) for i in range(len(PROMPTS))]
    seen = []
    for m in (model, other):
        samples = Engine(m).generate(PROMPTS, 1, GREEDY, tok.stop_ids, tok.pad_id, seeds(len(PROMPTS)))
        batch = make_sequences(PROMPTS, samples.completions, 1, tok.pad_id)
        batch.mask[torch.tensor(samples.truncated)] = 0.0
        seen.append((samples, batch.mask, rewards.score(rows, PROMPTS, samples, tok, 1)[0]))
    (first, mask, reward), (second, other_mask, other_reward) = seen
    assert [c[-1] for c, t in zip(first.completions, first.truncated) if not t] != \
        [c[-1] for c, t in zip(second.completions, second.truncated) if not t]  # the stops swapped
    assert [c[:-1] for c in first.completions] == [c[:-1] for c in second.completions]
    assert first.truncated == second.truncated and torch.equal(mask, other_mask)
    assert mask.sum(1).tolist() == [0.0 if t else len(c) for c, t in zip(first.completions, first.truncated)]
    texts = [tok.decode(c if t else c[:-1]) for c, t in zip(first.completions, first.truncated)]
    assert torch.equal(reward, other_reward) and reward[:, 1].tolist() == [float(len(t)) for t in texts]
    ended = [c if t else c[:-1] + [tok.eos_id] for c, t in zip(first.completions, first.truncated)]
    assert reward[:, 0].tolist() == rewards.rm.score_ids([p + c for p, c in zip(PROMPTS, ended)])


def test_the_stops_are_where_transformers_generate_stops(im_end_dir, tmp_path):
    """Oracle: the eos_token_id transformers' generate stops at (GenerationConfig.from_pretrained where the dir has a
    generation config, else from_model_config of its config.json, transformers' own fallback), plus the tokenizer's
    eos, which rendered replies end with: a list, an int, and no generation config."""
    from transformers import AutoConfig

    d = tmp_path / "model"
    shutil.copytree(im_end_dir, d)
    tok = AutoTokenizer.from_pretrained(d)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    cases = {"list": {"eos_token_id": [tok.eos_token_id, im_end]}, "int": {"eos_token_id": im_end}, "none": None}
    for name, generation in cases.items():
        (d / "generation_config.json").unlink(missing_ok=True)
        config = json.loads((im_end_dir / "config.json").read_text())
        if generation is None:  # only config.json says where a turn ends
            config["eos_token_id"] = [im_end, tok.eos_token_id]
        else:
            GenerationConfig(**generation).save_pretrained(d)
        (d / "config.json").write_text(json.dumps(config))
        theirs = (GenerationConfig.from_pretrained(d) if generation is not None else
                  GenerationConfig.from_model_config(AutoConfig.from_pretrained(d))).eos_token_id
        theirs = {theirs} if isinstance(theirs, int) else set(theirs)
        ours = load_tokenizer_for(load_backbone(d), None).stop_ids
        assert set(ours) == theirs | {tok.eos_token_id} and ours[0] == tok.eos_token_id, name
