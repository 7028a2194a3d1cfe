"""Your own tools and environments in rollouts (agent/agent.py), checked against what transformers renders: a
chat model's tool calls answered in its template's tool turns, nanochat's turns after an environment's answer, the
masks token by token, SFT's learnt tokens as transformers' return_assistant_tokens_mask marks them; failures as the
text a row reads; 1 rank = 2 ranks."""
from __future__ import annotations

import json
import threading
import time

import pytest
import tools_for_tests
import torch
from conftest import REPO, assert_same_update, run_script
from test_engine import aot_eager  # noqa: F401  (a fixture)
from test_tools import TOOL_USE
from torch._dynamo.utils import counters

from nanochat_ext.agent.agent import Agent, AgentConfig
from nanochat_ext.agent.formats import Call, block_call, hermes_calls, llama3_calls
from nanochat_ext.agent.toolbox import LATE, call_all
from nanochat_ext.algorithms.sft import sft_examples
from nanochat_ext.data.conversations import Conversation, conversation
from nanochat_ext.engine import scheduler
from nanochat_ext.engine.engine import Engine
from nanochat_ext.engine.sampling import SamplingConfig
from nanochat_ext.errors import InputError
from nanochat_ext.models.loader import load_backbone, load_tokenizer_for
from nanochat_ext.tasks import synthetic
from nanochat_ext.tasks.guessing_game import make_prompts
from nanochat_ext.tasks.multiplication import make_demonstrations, make_questions
from nanochat_ext.tokenizer import TokenizerWrapper
from scripts import kat_train_grpo

HF_TOOL_USE = REPO / "tests" / "fixtures" / "hf-tool-use"
MULTIPLY = "nanochat_ext.tasks.multiplication:multiply"
CALLS = [(12, 34), (7, 8), (25, 4), (9, 12)]  # the fixture's tool prompts, in its order; then two it answers itself
TESTS_ON_PATH = {"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}


@pytest.fixture(scope="module")
def hf_tool_use():
    bb = load_backbone(HF_TOOL_USE)
    rows = [{"prompt": json.loads(line)["messages"][0]["content"]}
            for line in (HF_TOOL_USE / "conversations.jsonl").read_text().splitlines()]
    return bb, load_tokenizer_for(bb, None), rows


@pytest.fixture(scope="module")
def templated(tmp_path_factory) -> dict[str, TokenizerWrapper]:
    """A tokenizer for each of the test templates (synthetic.TEMPLATES) that speak tools, and one that knows none."""
    d = tmp_path_factory.mktemp("templates")
    return {name: TokenizerWrapper.load(synthetic.make_tiny_hf_llama(d / name, template=name))
            for name in ("chatml", "chatml_tools", "llama3_tools")}


def decode(engine: Engine, agent: Agent, rows: list[dict], max_new: int = 60, temperature: float = 0.0, n: int = 1):
    ids = [agent.render_prompt([{"role": "user", "content": r["prompt"]}]) for r in rows]
    tok = agent.tok
    samples = engine.generate(ids, n, SamplingConfig(max_new, temperature), tok.stop_ids, tok.pad_id,
                              [torch.Generator().manual_seed(i) for i in range(len(rows))], rows)
    return ids, samples


def forced_runs(completion: list[int], sampled: list[int]) -> list[list[int]]:
    """The runs of forced tokens of a completion, in order."""
    runs, run = [], []
    for token, m in zip(completion, sampled):
        if not m:
            run.append(token)
        elif run:
            runs, run = runs + [run], []
    return runs + ([run] if run else [])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_tool_calls_are_answered_in_the_chat_templates_tool_turns(hf_tool_use, compiled, aot_eager):  # noqa: F811
    """A chat model that calls `multiply` in the hermes format (tests/fixtures/hf-tool-use, which memorised the wrong
    result 99): each call ends its turn, the true product comes back in a tool turn, and the model answers. Each
    rollout is token for token what transformers' apply_chat_template renders for that conversation, and its mask is
    transformers' assistant mask: 1 on the assistant's turns through <|im_end|>, 0 on the tool turn and the next
    turn's opening. The rows that answer without a tool end after one turn. Eager and compiled alike."""
    bb, tok, rows = hf_tool_use
    agent = Agent(AgentConfig(tools=MULTIPLY), tok, rows[0])
    torch._dynamo.reset()
    ids, got = decode(Engine(bb, compile=compiled, agent=agent), agent, rows)
    assert got.turns == [2, 2, 2, 2, 1, 1] and (got.tool_calls, got.tool_errors) == (4, 0)
    for i, (a, b) in enumerate(CALLS):
        call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
        talk = [{"role": "user", "content": rows[i]["prompt"]},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": str(a * b)}, {"role": "assistant", "content": "It is 99."}]
        want = tok._impl.apply_chat_template(talk, tools=agent.template_tools, tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
        end = len(ids[i]) + len(got.completions[i])
        assert ids[i] + got.completions[i] == want["input_ids"][:end], tok.decode(got.completions[i])
        assert tok._impl.decode(want["input_ids"][end:]) == "\n"  # what the template writes after the last turn
        assert got.sampled[i] == want["assistant_masks"][len(ids[i]):end]
    assert [tok._impl.decode(c) for c in got.completions[4:]] == ["hi<|im_end|>", "blue<|im_end|>"]
    if compiled:
        assert not counters["graph_break"], dict(counters["graph_break"])


def test_rewards_read_the_last_assistant_turn_not_what_a_tool_said(hf_tool_use):
    """The fixture's model answers 99 after the tool gives the product. Its rewards read that last turn ("It is
    99."), never the tool turn: a rollout the budget cuts just after the tool turn states the product gives the
    rewards an empty turn, though its text holds the product."""
    bb, tok, rows = hf_tool_use
    agent = Agent(AgentConfig(tools=MULTIPLY), tok, rows[0])
    engine = Engine(bb, agent=agent)
    _, whole = decode(engine, agent, rows[:1])
    assert whole.replies(tok) == ["It is 99."]
    completion, sampled = whole.completions[0], whole.sampled[0]
    first = sampled.index(0)  # the tool turn, forced
    cut = next(k for k in range(first, len(completion)) if "408" in tok.decode(completion[first:k]))
    _, short = decode(engine, agent, rows[:1], max_new=cut)
    assert short.completions[0] == completion[:cut] and "408" in tok.reply_text(short.completions[0])
    assert short.replies(tok) == [""]


def test_a_tool_that_raises_hangs_or_returns_junk_is_an_error_its_row_reads(hf_tool_use):
    """tools_for_tests:multiply raises for 12, hangs for 7, returns an object for 25: each row reads an error in its
    tool turn (the hang's after --tool_timeout, while the call is abandoned) and goes on; 9 x 12 is answered."""
    bb, tok, rows = hf_tool_use
    agent = Agent(AgentConfig(tools="tools_for_tests:multiply", tool_timeout=0.5), tok, rows[0])
    _, got = decode(Engine(bb, agent=agent), agent, rows[:4], max_new=200)
    tool_turns = [tok._impl.decode(forced_runs(c, m)[0]) for c, m in zip(got.completions, got.sampled)]
    assert tool_turns == [f"\n<|im_start|>tool\n{text}<|im_end|>\n<|im_start|>assistant\n" for text in (
        "Error: tool multiply raised ValueError: twelve is unlucky",
        "Error: tool multiply did not answer within 0.5 s",
        "Error: tool multiply returned object, not text or JSON", "108")]
    assert (got.tool_calls, got.tool_errors, got.turns) == (4, 3, [2, 2, 2, 2])


@pytest.mark.parametrize("spec,line", [
    ("tools_for_tests:undocumented", "has no docstring"),
    ("tools_for_tests:untyped", "a type hint on every argument"),
    ("multiply", "give module:function"),
    ("no_such_module:f", "cannot import 'no_such_module'"),
    ("tools_for_tests:missing", "has no function 'missing'"),
    ("tools_for_tests:multiply,nanochat_ext.tasks.multiplication:multiply", "names 'multiply' twice"),
    ("calculator", "runs in nanochat's python blocks"),
    ("none,tools_for_tests:multiply", "none goes alone"),
])
def test_a_tool_that_cannot_be_used_is_one_line_at_start(hf_tool_use, spec, line):
    with pytest.raises(InputError, match=line):
        Agent(AgentConfig(tools=spec), hf_tool_use[1])


def test_an_environment_factory_that_fails_or_makes_no_environment_is_one_line(hf_tool_use):
    with pytest.raises(InputError, match="the factory raised KeyError"):
        Agent(AgentConfig(env="nanochat_ext.tasks.guessing_game:GuessingGame"), hf_tool_use[1], {"prompt": "x"})
    with pytest.raises(InputError, match="has no step"):
        Agent(AgentConfig(env="tools_for_tests:undocumented"), hf_tool_use[1], {"prompt": "x"})


def test_calls_read_back_as_the_template_wrote_them(templated):
    """A tool call rendered by the hermes and the Llama 3 templates (transformers' apply_chat_template) reads back as
    the call it was; a turn without one reads as none. nanochat's blocks: a call of one of your tools, with literal
    arguments, positional or named, else the calculator's."""
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 347, "b": 829}}}
    for name, read, opening, end, n in (
            ("chatml_tools", hermes_calls, "<|im_start|>assistant\n", "<|im_end|>", 2),
            ("llama3_tools", llama3_calls, "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>", 1)):
        talk = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call, call]}]
        text = templated[name]._impl.apply_chat_template(talk, tokenize=False)
        turn = text.split(opening)[-1].split(end)[0]  # the assistant's turn as the model would write it
        assert read(turn) == [Call("multiply", {"a": 347, "b": 829})] * n, turn  # Llama 3 writes one call a turn
        assert read("The answer is 287663.") == []
    assert hermes_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call> <tool_call>{oops') == [
        Call("f", {"x": 1}), Call("?", problem="the tool call is not JSON (Expecting property name enclosed in double "
                                               "quotes)")]
    params = {"multiply": ["a", "b"]}
    assert block_call("multiply(3, b=4)", params) == Call("multiply", {"a": 3, "b": 4})
    assert block_call("3*4", params) is None and block_call("'ab'.count('a')", params) is None
    assert block_call("multiply(x, 4)", params).problem.startswith("its arguments must be literals")


def test_whatever_the_model_writes_in_a_call_is_read_without_raising(hf_tool_use):
    """Calls no parser can read (an unhashable literal, a NUL byte, JSON nested past the parser's depth) and
    arguments of the wrong type for a union-typed parameter: each a problem the model reads, none an exception."""
    params = {"multiply": ["a", "b"]}
    assert block_call("multiply({[1]: 2}, 3)", params).problem.startswith("its arguments must be literals")
    assert block_call("multiply(1,\x00 2)", params) is None  # ast refuses it: not a call of a tool
    deep = hermes_calls("<tool_call>" + "[" * 100_000 + "</tool_call>")
    assert len(deep) == 1 and deep[0].problem.startswith("the tool call is not JSON")
    agent = Agent(AgentConfig(tools="tools_for_tests:lookup"), hf_tool_use[1])
    ok, text, wrong = agent.call([Call("lookup", {"key": "k", "default": value}) for value in (3, "x", [1])])
    assert (ok.text, text.text) == ("k: 3", "k: x") and not (ok.error or text.error)
    assert wrong.error and wrong.text == "Error: argument default must be integer or string, got [1]"
    nothing, a_set = agent.call([Call("lookup", {"key": "k", "default": None}), Call("lookup", {"key": {1, 2}})])
    assert nothing.text == "k: None" and not nothing.error  # `int | str | None`: transformers writes it nullable
    assert a_set.text == "Error: argument key must be string, got \"{1, 2}\""  # a set, from a python block


def test_an_episode_ends_on_no_turns_and_a_failed_environment_costs_its_row_only(hf_tool_use):
    """An environment that answers [] ends the episode; a factory that fails for one row leaves that row without an
    environment (counted, reward 0) and the others playing; a tool call in the last turn allowed is not answered, and
    the environment does not see it."""
    tok = hf_tool_use[1]
    agent = Agent(AgentConfig(tools=MULTIPLY, env="tools_for_tests:QuietGame", max_turns=1), tok, {})
    episodes = agent.episodes([{}, {"fail": 1}], 1)
    assert episodes.env_errors == 1 and episodes.envs[1] is None
    call = '<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call>'
    assert episodes.after_turns([0, 1], [call, "six"], room=50) == [None, None]
    assert episodes.envs[0].seen == [] and episodes.tool_calls == 0
    assert episodes.after_turns([0], ["six"], room=50) == [None] and episodes.envs[0].seen == ["six"]
    assert [o.value for o in episodes.env_rewards()] == [1.0, 0.0]


def test_sft_learns_a_chat_models_turns_as_transformers_marks_them(templated):
    """SFT renders a tool conversation (a call, the tool's turn, the answer) and a two-turn chat with each model's
    chat template, and learns exactly the tokens transformers' return_assistant_tokens_mask marks: every assistant
    turn through its end-of-turn token (Llama 3's <|eot_id|>, not the tokenizer's eos <|end_of_text|>), no tool
    turn, no template text between turns. A template that writes no tool calls (chatml) gets them in the format."""
    demo = make_demonstrations(make_questions(1, 0, 0)[0])[0]
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "and?"}, {"role": "assistant", "content": "bye"}]
    for name, tok in templated.items():
        agent = Agent(AgentConfig(tools=MULTIPLY), tok)
        for talk in (demo["messages"], chat):
            c = conversation(talk, "conversations.jsonl", 1)
            [(p, r, mask)] = sft_examples([c], tok, 10 ** 6, agent, "conversations.jsonl")
            rendered = agent.for_template(c.prompt + c.turns)
            want = tok._impl.apply_chat_template(rendered, tools=agent.template_tools, tokenize=True, return_dict=True,
                                                 return_assistant_tokens_mask=True)
            # transformers marks every assistant turn; SFT learns those after the last user turn (the rest is prompt)
            assert p + r == want["input_ids"][:len(p) + len(r)]
            assert mask == want["assistant_masks"][len(p):len(p) + len(r)] and sum(mask) > 0, name
            assert r[-1] in tok.stop_ids and r[-1] != (tok.eos_id if name == "llama3_tools" else -1), name
            if name == "chatml" and talk is demo["messages"]:  # the call as the hermes format writes it
                assert '<tool_call>\n{"name": "multiply", "arguments": {"a": ' in tok.decode(r)
    nanochat = load_tokenizer_for(load_backbone(TOOL_USE / "chatsft_checkpoints" / "d2"), str(TOOL_USE / "tokenizer"))
    with pytest.raises(InputError, match="conversations.jsonl:1: field 'messages': tool calls and tool turns need"):
        sft_examples([Conversation(demo["messages"][:1], demo["messages"][1:], 1)], nanochat, 10 ** 6,
                     Agent(AgentConfig(), nanochat), "conversations.jsonl")
    # nanochat's SFT prompts list your tools as its rollouts' prompts do (the calculator alone: nanochat's own)
    question, answer = [{"role": "user", "content": "What is 3 times 4?"}], [{"role": "assistant", "content": "12"}]
    for tools, listed in (("calculator", False), (f"calculator,{MULTIPLY}", True)):
        agent = Agent(AgentConfig(tools=tools), nanochat)
        [(p, _, _)] = sft_examples([Conversation(question, answer, 1)], nanochat, 10 ** 6, agent, "c.jsonl")
        assert p == agent.render_prompt(question) and (p != nanochat.render_prompt(question)) == listed


def test_without_tools_the_prompts_are_the_templates_own(templated):
    """No tools (--tools none, or an environment alone): every template renders the prompt it renders without
    tools, Llama 3's too, whose template writes its tool block for any `tools` that is not None, [] included."""
    question = [{"role": "user", "content": "What is 3 times 4?"}]
    for name, tok in templated.items():
        for cfg in (AgentConfig(tools="none"), AgentConfig(tools="none", env="tools_for_tests:CountingGame")):
            assert Agent(cfg, tok, {}).render_prompt(question) == tok.render_prompt(question), name


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_environment_answers_each_turn_and_gives_the_reward(compiled, aot_eager):  # noqa: F811
    """nanochat's tool-use model in an environment that asks twice for another turn, then ends: each row's forced runs
    are the calculator's answers and the environment's user turns as nanochat renders them (<|user_start|> ..
    <|user_end|><|assistant_start|>), in order; a row that ends its turns has 3 of them and the reward the
    environment counts; one that runs out of tokens stops where it is. Eager and compiled alike."""
    bb = load_backbone(TOOL_USE / "chatsft_checkpoints" / "d2")
    tok = load_tokenizer_for(bb, str(TOOL_USE / "tokenizer"))
    rows = [{"prompt": q} for q in ("what is 3 times 4?", "Share 1,200 pies among 4 kids.",
                                    "How many r are in strawberry?")]
    agent = Agent(AgentConfig(env="tools_for_tests:CountingGame"), tok, rows[0])
    torch._dynamo.reset()
    _, got = decode(Engine(bb, compile=compiled, agent=agent), agent, rows, max_new=90, temperature=1.0, n=2)
    rewards = [o.value for o in got.episodes.env_rewards()]
    output_start = tok.special("<|output_start|>")
    for c, m, turns, truncated, reward in zip(got.completions, got.sampled, got.turns, got.truncated, rewards):
        asked = [run for run in forced_runs(c, m) if run[0] != output_start]
        assert asked == [tok.render_followup([{"role": "user", "content": f"again {k}"}]) for k in (1, 2)][:turns - 1]
        assert (turns, reward, c[-1]) == (3, 3.0, tok.eos_id) or (truncated and reward == turns - 1)
    assert got.turns.count(3) >= 3 and got.tool_calls > 0
    if compiled:
        assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_decoding_drops_rows_that_ended_their_episodes_and_samples_the_same(compiled, aot_eager,  # noqa: F811
                                                                             monkeypatch):
    """#67 item 2 with an agent: the rows whose episode ended (no next turn) are dropped, with their tool state, once
    they are a quarter of the batch (eager), or move into a state of half the rows once they fit in it (compiled;
    6 rows into 3, COMPACT_MIN_ROWS lowered for a batch this small); a row whose turn ended and that the environment
    asked for another stays. The completions, their sampled/forced marks, turns, tool calls and rewards are those of
    decoding every row to the end (up to a tie), with fewer row-steps. nanochat's tool-use model, the calculator's
    blocks and CountingGame."""
    monkeypatch.setattr(scheduler, "COMPACT_MIN_ROWS", 2)
    bb = load_backbone(TOOL_USE / "chatsft_checkpoints" / "d2")
    tok = load_tokenizer_for(bb, str(TOOL_USE / "tokenizer"))
    rows = [{"prompt": q} for q in ("what is 3 times 4?", "Share 1,200 pies among 4 kids.",
                                    "How many r are in strawberry?")]
    runs = {}
    for drop in (False, True):
        agent = Agent(AgentConfig(env="tools_for_tests:CountingGame"), tok, rows[0])
        engine = Engine(bb, agent=agent, drop_finished=drop, compile=compiled)
        runs[drop] = decode(engine, agent, rows, max_new=90, temperature=1.0, n=2)[1], engine.last
        assert sorted(engine.states) == ([] if not compiled else [3, 6] if drop else [6]), sorted(engine.states)
    (kept, kept_stats), (dropped, dropped_stats) = runs[False], runs[True]
    assert kept_stats.row_steps == 6 * kept_stats.steps and dropped_stats.row_steps < kept_stats.row_steps
    parted = [i for i, (a, b) in enumerate(zip(kept.completions, dropped.completions)) if a != b]
    assert len(parted) <= 1, parted
    same = [i for i in range(6) if i not in parted]
    for got in (kept, dropped):
        assert got.turns.count(3) >= 3 and got.tool_calls > 0
    assert [kept.sampled[i] for i in same] == [dropped.sampled[i] for i in same]
    assert [kept.turns[i] for i in same] == [dropped.turns[i] for i in same]
    rewards = [[o.value for o in got.episodes.env_rewards()] for got in (kept, dropped)]
    assert [rewards[0][i] for i in same] == [rewards[1][i] for i in same]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_environment_talks_with_a_chat_model_in_its_template(hf_tool_use, compiled, aot_eager):  # noqa: F811
    """The chat model in an environment that asks twice for another turn, then ends: each rollout is token for token
    transformers' rendering of that conversation (the environment's turns as user turns, every assistant turn through
    <|im_end|>), and its mask transformers' assistant mask: the template's turns between forced, the rest sampled.
    Eager and compiled alike."""
    bb, tok, rows = hf_tool_use
    agent = Agent(AgentConfig(tools="none", env="tools_for_tests:CountingGame"), tok, rows[0])
    torch._dynamo.reset()
    ids, got = decode(Engine(bb, compile=compiled, agent=agent), agent, rows[4:], max_new=150)
    assert got.turns == [3, 3] and not any(got.truncated)
    asked = [{"role": "user", "content": f"again {k}"} for k in (1, 2)]
    for i, (c, m) in enumerate(zip(got.completions, got.sampled)):
        assert forced_runs(c, m) == [tok.render_followup([a]) for a in asked]
        talk = [{"role": "user", "content": rows[4 + i]["prompt"]}]
        for k, reply in enumerate(got.episodes.envs[i].seen):
            talk += [{"role": "assistant", "content": reply}, *asked[k:k + 1]]
        want = tok._impl.apply_chat_template(talk, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        end = len(ids[i]) + len(c)
        assert ids[i] + c == want["input_ids"][:end] and tok._impl.decode(want["input_ids"][end:]) == "\n"
        assert m == want["assistant_masks"][len(ids[i]):end]
    assert [o.value for o in got.episodes.env_rewards()] == [3.0, 3.0]
    if compiled:
        assert not counters["graph_break"], dict(counters["graph_break"])


def test_your_tool_in_nanochats_python_blocks():
    """In nanochat's format a block `name(literal arguments)` calls your tool and its answer is forced inside
    <|output_start|>..<|output_end|>; any other block is the calculator's (nothing where it refuses), or an error
    the row reads where the calculator is off."""
    tok = load_tokenizer_for(load_backbone(TOOL_USE / "chatsft_checkpoints" / "d2"), str(TOOL_USE / "tokenizer"))
    out_start, out_end = tok.special("<|output_start|>"), tok.special("<|output_end|>")

    def answered(text: str) -> list[int]:
        return [out_start, *tok.encode(text), out_end]

    blocks = ["multiply(12, b=34)", "3*4", "multiply(x, 4)", "print(1)"]
    with_calculator = Agent(AgentConfig(tools=f"calculator,{MULTIPLY}"), tok).episodes([{}], 1)
    assert with_calculator.answer_blocks(blocks, [0] * 4) == [
        answered("408"), answered("12"),
        answered("Error: its arguments must be literals (numbers, strings, lists, dicts)"), []]
    assert (with_calculator.tool_calls, with_calculator.tool_errors) == (4, 2)
    alone = Agent(AgentConfig(tools=MULTIPLY), tok).episodes([{}], 1)
    assert alone.answer_blocks(blocks[:2], [0, 0])[1] == answered(
        "Error: not a call of a tool, name(arguments) (tools: multiply)")


def test_an_environment_that_answers_junk_or_raises_is_an_error_its_row_reads():
    bb = load_backbone(TOOL_USE / "chatsft_checkpoints" / "d2")
    tok = load_tokenizer_for(bb, str(TOOL_USE / "tokenizer"))
    agent = Agent(AgentConfig(env="tools_for_tests:BrokenGame", max_turns=3), tok, {})
    _, got = decode(Engine(bb, agent=agent), agent, [{"prompt": "what is 3 times 4?"}], max_new=250)
    asked = [tok.decode(run) for run in forced_runs(got.completions[0], got.sampled[0])
             if run[0] == tok.special("<|user_start|>")]
    assert asked == ["<|user_start|>Error: the environment answered int '42', not a message<|user_end|>"
                     "<|assistant_start|>", "<|user_start|>Error: the environment's step on row 0 raised RuntimeError: "
                     "the board fell over<|user_end|><|assistant_start|>"]
    assert (got.turns, got.env_errors) == ([3], 3)  # the last turn's step raised too: no one reads it


def grpo_rollouts(out) -> dict[tuple, tuple]:
    """(step, prompt, sample) -> (completion ids, sampled mask), the last written of each (a resumed run writes its
    step again)."""
    rows = [json.loads(line) for line in (out / "logs" / "rollouts.jsonl").read_text().splitlines()]
    return {(r["step"], r["prompt_index"], r["sample"]): (r["completion_ids"], r["sampled"]) for r in rows}


def test_grpo_with_your_tools_on_two_ranks_is_one_rank(tmp_path, hf_tool_use):
    """GRPO on the chat model that calls `multiply`: 2 ranks sample the rollouts 1 rank samples, tool turns and
    masks included, and take the same update."""
    prompts = synthetic.write_jsonl(tmp_path / "prompts.jsonl", hf_tool_use[2])
    args = ["--policy", str(HF_TOOL_USE), "--prompts", str(prompts), "--tools", MULTIPLY, "--reward_fn",
            "rewards_for_tests:vowel_share", "--temperature", "1.5", "--batch_size", "2", "--group_size", "4",
            "--max_new_tokens", "48", "--max_steps", "2", "--lr", "1e-3", "--beta", "0", "--log_rollouts",
            "--log_every", "1", "--device", "cpu"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert kat_train_grpo.main([*args, "--out", str(one)]) == 0
    proc = run_script("scripts.kat_train_grpo", [*args, "--out", str(two)], nproc=2, env=TESTS_ON_PATH)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert grpo_rollouts(one) == grpo_rollouts(two)
    assert any(0 in sampled and sampled[-1] == 1 for _, sampled in grpo_rollouts(one).values())  # answered after a tool
    metrics = [json.loads(line) for line in (one / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert max(m.get("train/turns", 0) for m in metrics) > 1 and max(m.get("train/tool_calls", 0) for m in metrics) > 0
    init, got, want = (load_backbone(d).model.state_dict() for d in (HF_TOOL_USE, two, one))
    assert_same_update(got, want, init)


@pytest.mark.parametrize("async_rollouts", ["0", "1"])
def test_grpo_in_an_environment_on_two_ranks_resumes_to_one_ranks_run(tmp_path, async_rollouts):
    """GRPO in the guessing game (nanochat's tool-use model, its calculator on too), the game's reward beside a
    reward function: 2 ranks, killed after step 1 and resumed, sample 1 rank's rollouts and end at its weights; also
    with --async_rollouts 1 (the episodes played in the rollout thread, the draw in flight kept in the checkpoint)."""
    prompts = synthetic.write_jsonl(tmp_path / "prompts.jsonl", make_prompts(4, seed=0, high=20))
    args = ["--policy", str(TOOL_USE / "chatsft_checkpoints" / "d2"), "--tokenizer", str(TOOL_USE / "tokenizer"),
            "--prompts", str(prompts), "--env", "nanochat_ext.tasks.guessing_game:GuessingGame", "--max_turns", "3",
            "--reward_fn", "rewards_for_tests:vowel_share", "--temperature", "2", "--batch_size", "2",
            "--group_size", "4", "--max_new_tokens", "40", "--max_steps", "2", "--lr", "1e-3", "--beta", "0",
            "--log_rollouts", "--log_every", "1", "--device", "cpu", "--async_rollouts", async_rollouts]
    one, two = tmp_path / "one", tmp_path / "two"
    assert kat_train_grpo.main([*args, "--out", str(one)]) == 0
    for extra in (["--save_every", "1"], ["--resume", "latest"]):
        proc = run_script("scripts.kat_train_grpo", [*args, "--out", str(two), *extra], nproc=2, env=TESTS_ON_PATH)
        assert proc.returncode == 0, proc.stderr[-2000:]
        if extra[0] == "--save_every":  # "killed" after step 1: its step-2 checkpoint gone
            last = max(int(p.stem.split("_")[1]) for p in two.glob("model_*.pt"))
            for name in (f"model_{last}.pt", f"meta_{last}.json", f"state_{last}.pt"):
                (two / name).unlink()
    assert "resume: from" in proc.stdout
    assert grpo_rollouts(one) == grpo_rollouts(two)
    metrics = [json.loads(line) for line in (one / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert all("train/reward_env" in m and m["train/turns"] > 1 for m in metrics if "train/turns" in m)
    init, got, want = (load_backbone(d).model.state_dict() for d in (TOOL_USE / "chatsft_checkpoints" / "d2", two, one))
    # backout_lambda's gradient is rounding at 2 layers (test_tools.test_no_gradient_flows_through_forced_tokens)
    assert_same_update(*({k: v for k, v in sd.items() if k != "backout_lambda"} for sd in (got, want, init)))


def test_an_agents_late_calls_count_against_its_own_cap_not_the_next_runs(assets):
    """#80 item 3: calls still running past their timeout belong to the run (its Agent) that made them: once one run
    has --max_late_calls of them its new calls are refused, while the next run's agent, in the same process, calls."""
    tok, release = TokenizerWrapper.load(assets["tokenizer"]), threading.Event()
    cfg = AgentConfig(tools="none", tool_timeout=0.01, max_late_calls=2)
    first, second = Agent(cfg, tok), Agent(cfg, tok)
    try:
        assert all(o.timed_out for o in first.call_all([("tool hang", lambda: release.wait(60))] * 2))
        assert first.call_all([("tool quick", lambda: 3)])[0].refused
        assert second.call_all([("tool quick", lambda: 3)])[0].text == "3"
    finally:
        release.set()


def test_overrunning_calls_are_capped_and_a_thread_that_cannot_start_is_an_error(monkeypatch):
    """A tool that hangs on every call, 4 calls a step for 200 steps: calls past their timeout stay counted until
    they end, and once max_late are running new calls are refused (an error the row reads) instead of piling up
    threads: the live threads never exceed the cap and one step's calls. A thread the OS will not start is an
    error the row reads too."""
    release = threading.Event()
    threads_before, late_before = threading.active_count(), LATE.count()  # earlier tests' hangs may still run
    cap = late_before + 8
    hang = ("tool hang", lambda: release.wait(60))
    try:
        for step in range(200):
            out = call_all([hang] * 4, timeout=0.01, max_late=cap)
            assert threading.active_count() - threads_before <= 8 + 4
            if step == 2:
                rss = resident_mb()
            if step >= 2:
                assert all(o.refused and "still running past their timeout" in o.text for o in out)
        assert LATE.count() == cap and resident_mb() - rss < 5  # flat once the cap is reached
    finally:
        release.set()
    deadline = time.monotonic() + 5
    while LATE.count() > late_before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert call_all([("tool quick", lambda: 3)], timeout=1, max_late=cap)[0].text == "3"

    def no_thread(self):
        raise RuntimeError("can't start new thread")
    monkeypatch.setattr(threading.Thread, "start", no_thread)
    out = call_all([("tool quick", lambda: 3)], timeout=1)
    assert out[0].error and out[0].text == "Error: tool quick could not be started (RuntimeError: can't start new " \
                                           "thread)"


def resident_mb() -> float:
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1]) / 1024


def test_a_timed_out_environment_is_ended_and_never_stepped_again(hf_tool_use):
    """Its step ran past --tool_timeout: the episode ends there, the environment is never stepped or asked for its
    reward again (the late step still ends, and changes nothing the run reads), its reward is 0, counted."""
    tools_for_tests.LATE_STEPS.clear()
    agent = Agent(AgentConfig(env="tools_for_tests:SlowGame", tool_timeout=0.2, max_turns=4), hf_tool_use[1], {})
    episodes = agent.episodes([{}, {}], 1)
    episodes.envs[1].steps = 1  # row 1's game answers at once
    assert episodes.after_turns([0, 1], ["first", "first"], room=50)[0] is None
    assert (episodes.envs[0], episodes.env_timeouts, episodes.env_errors) == (None, 1, 1)
    time.sleep(0.6)  # the late step ends, unread
    assert episodes.after_turns([0, 1], ["second", "second"], room=50)[0] is None
    assert [o.value for o in episodes.env_rewards()] == [0.0, 1.0]
    assert tools_for_tests.LATE_STEPS == ["first", "first", "second", "get_reward"]  # row 0's game: its late step


def test_each_environment_gets_its_own_copy_of_the_row_and_a_factory_its_time_limit(hf_tool_use):
    rows = [{"prompt": "p", "meta": {"seen": 0}}]
    agent = Agent(AgentConfig(env="tools_for_tests:MeddlingGame"), hf_tool_use[1], rows[0])
    agent.episodes(rows, 4)
    assert rows == [{"prompt": "p", "meta": {"seen": 0}}]
    code = Agent(AgentConfig(env="nanochat_ext.tasks.code_tests:CodeTests", tool_timeout=4), hf_tool_use[1],
                 {"tests": "assert f() == 1"})
    assert code.episodes([{"tests": "assert f() == 1"}], 1).envs[0].time_limit == 3.0
    assert "the model's code runs " in code.describe()


def test_a_turns_tool_calls_are_capped(hf_tool_use):
    """--max_tool_calls: calls past it in one turn are refused, not run, in a chat format's turn and in nanochat's
    python blocks (counted per row and turn)."""
    agent = Agent(AgentConfig(tools=MULTIPLY, max_tool_calls=2), hf_tool_use[1])
    episodes = agent.episodes([{}], 1)
    call = '<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call>'
    forced = episodes.after_turns([0], [call * 5], room=500)[0]
    text = hf_tool_use[1]._impl.decode(forced)
    assert text.count("tool\n6<") == 2 and text.count("at most 2 tool calls a turn (--max_tool_calls)") == 3, text
    assert (episodes.tool_calls, episodes.tool_errors) == (5, 3)
    tok = load_tokenizer_for(load_backbone(TOOL_USE / "chatsft_checkpoints" / "d2"), str(TOOL_USE / "tokenizer"))
    blocks = Agent(AgentConfig(tools=MULTIPLY, max_tool_calls=2), tok).episodes([{}, {}], 1)
    answers = [tok.decode(ids) for ids in blocks.answer_blocks(["multiply(2, 3)"] * 4, rows=[0, 0, 1, 0])]
    assert ["6" in a for a in answers] == [True, True, True, False] and "--max_tool_calls" in answers[3]


def test_calls_are_read_strictly(templated):
    """An argument given twice, *args and **kwargs are errors the model reads; a schema's enum and array items are
    checked before the tool runs."""
    params = {"multiply": ["a", "b"]}
    assert block_call("multiply(1, 2, a=3)", params).problem == "multiply got argument a twice"
    assert block_call("multiply(**{'a': 1, 'b': 2})", params).problem.startswith("write each argument out")
    assert block_call("multiply(*[1, 2])", params).problem.startswith("write each argument out")
    agent = Agent(AgentConfig(tools="tools_for_tests:paint"), templated["chatml_tools"])
    good, color, item = agent.call([Call("paint", {"color": "red", "sizes": [1, 2]}),
                                    Call("paint", {"color": "green", "sizes": []}),
                                    Call("paint", {"color": "blue", "sizes": [1, "2"]})])
    assert good.text == "red [1, 2]" and not good.error
    assert color.text == "Error: argument color must be one of [\"red\", \"blue\"], got \"green\""
    assert item.text == "Error: argument sizes item 1 must be integer, got \"2\""


def test_a_grpo_run_whose_tool_times_out_ends_well_and_says_so(tmp_path, hf_tool_use, capsys):
    """tools_for_tests:multiply hangs on 7 x 8: the run finishes, logs the timeouts, and says once that such
    rollouts depend on the clock."""
    prompts = synthetic.write_jsonl(tmp_path / "prompts.jsonl", hf_tool_use[2][1:2])
    args = ["--policy", str(HF_TOOL_USE), "--prompts", str(prompts), "--tools", "tools_for_tests:multiply",
            "--tool_timeout", "0.3", "--reward_fn", "rewards_for_tests:vowel_share", "--batch_size", "1",
            "--group_size", "2", "--max_new_tokens", "40", "--max_steps", "1", "--log_every", "1", "--val_ratio", "0",
            "--device", "cpu",
            "--out", str(tmp_path / "out")]
    assert kat_train_grpo.main(args) == 0
    said = capsys.readouterr().out
    assert said.count("note: 2 tool or environment calls ran past --tool_timeout 0.3 s") == 1, said
    metrics = [json.loads(line) for line in (tmp_path / "out" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [m["train/tool_timeouts"] for m in metrics if "train/tool_timeouts" in m] == [1.0]
