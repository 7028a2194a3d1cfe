"""GSM8K against nanochat's own tasks/gsm8k.py (tests/fixtures/nanochat-tool-use/gsm8k.json, made by nanochat
92d63d4): the rows rendered as its conversations, prompts and SFT masks, its answer extraction and reward,
quirks included."""
from __future__ import annotations

import json

import pytest
from conftest import REPO

from nanochat_ext.algorithms.rewards import load_reward_fn
from nanochat_ext.data.conversations import load_conversations
from nanochat_ext.data.gsm8k import answer_parts, extract_answer, reference_answer
from nanochat_ext.data.rows import load_prompts
from nanochat_ext.errors import InputError
from nanochat_ext.tasks import reward_fns
from nanochat_ext.tokenizer import TokenizerWrapper
from nanochat_ext.training.logprobs import make_sequences
from scripts import kat_sft

TOOL_USE = REPO / "tests" / "fixtures" / "nanochat-tool-use"
FIXTURE = json.loads((TOOL_USE / "gsm8k.json").read_text())
ROWS = FIXTURE["rows"]
EXAMPLES = FIXTURE["examples"]  # examples[i] is rows[examples[i]["row"]] (nanochat shuffles)


@pytest.fixture(scope="module")
def tok():
    return TokenizerWrapper.load(TOOL_USE / "tokenizer")


@pytest.mark.parametrize("example", EXAMPLES, ids=[str(e["index"]) for e in EXAMPLES])
def test_rows_render_as_nanochats_conversations(example, tok):
    row = ROWS[example["row"]]
    user, assistant = example["conversation"]["messages"]
    assert answer_parts(row["answer"]) == assistant["content"]
    assert reference_answer(row["answer"]) == example["reference_answer"]
    prompt = tok.render_prompt([{"role": "user", "content": row["question"]}])
    assert prompt == example["render_for_completion"]
    reply, mask = tok.render_reply(assistant["content"])
    assert prompt + reply == example["render_conversation_ids"]
    assert [0] * len(prompt) + mask == example["render_conversation_mask"]  # python outputs: not trained


@pytest.mark.parametrize("completion", FIXTURE["completions"], ids=[c["completion"] for c in FIXTURE["completions"]])
def test_answer_and_reward_are_nanochats(completion):
    """`72.0` and `72.` score 0 against 72, `7,2` scores 1, `####72` and `#### $21` have no answer: as nanochat."""
    assert extract_answer(completion["completion"]) == completion["extract_answer"]
    gsm8k = load_reward_fn("gsm8k")
    for example, want in zip(EXAMPLES, completion["reward"]):
        assert gsm8k("", completion["completion"], ROWS[example["row"]]) == want


def test_numeric_reward_is_named_apart_and_reads_values():
    row = {"answer": "She has <<48-24=24>>24 left.\n#### 72"}
    assert [reward_fns.gsm8k_numeric("", c, row) for c in ("#### 72.0", "#### 72.", "#### 72", "#### 1.2.3")] == \
        [1.0, 1.0, 1.0, 0.0]
    assert reward_fns.gsm8k("", "#### 72.0", row) == 0.0


def test_gsm8k_files_load_as_prompts_and_as_conversations(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    prompts = load_prompts(path)
    assert [p.messages for p in prompts] == [[{"role": "user", "content": r["question"]}] for r in ROWS]
    assert [p.row["answer"] for p in prompts] == [r["answer"] for r in ROWS]  # the reward reads it
    conversations = load_conversations(path)
    assert [c.turns for c in conversations] == [[{"role": "assistant", "content": answer_parts(r["answer"])}]
                                                for r in ROWS]


def test_sft_batches_leave_python_outputs_out_of_the_loss(tok):
    """The SFT batch's loss mask is nanochat's: 0 on every <|output_start|> .. <|output_end|> token."""
    parts = EXAMPLES[1]["conversation"]["messages"][1]["content"]
    reply, mask = tok.render_reply(parts)
    batch = make_sequences([EXAMPLES[1]["render_for_completion"]], [reply], 1, tok.pad_id, token_mask=[mask])
    output = {tok.special("<|output_start|>"), tok.special("<|output_end|>")}
    in_output, expected = False, []
    for t in reply:
        in_output = in_output or t == tok.special("<|output_start|>")
        expected.append(0.0 if in_output else 1.0)
        in_output = in_output and t != tok.special("<|output_end|>")
    assert batch.mask[0].tolist() == expected and expected.count(0.0) > len(output)


def test_sft_runs_on_gsm8k_rows(tmp_path, capsys):
    """kat_sft on GSM8K rows from nanochat's tool-use checkpoint, end to end."""
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "sft"
    assert kat_sft.main(["--backbone", str(TOOL_USE / "chatsft_checkpoints" / "d2"), "--tokenizer",
                         str(TOOL_USE / "tokenizer"), "--conversations", str(path), "--batch_size", "3",
                         "--max_steps", "2", "--lr", "1e-3", "--out", str(out), "--device", "cpu"]) == 0
    assert "checkpoint: " in capsys.readouterr().out


def test_nanochat_conversations_with_reply_parts_load_and_bad_parts_are_one_line(tmp_path):
    """nanochat's own conversation format (the fixture's): the reply as parts loads as they are; parts anywhere but the
    reply, a part of an unknown type, or a parts reply without its role, are refused naming the file and row."""
    conversation = EXAMPLES[0]["conversation"]
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(conversation) + "\n")
    [c] = load_conversations(good)
    assert c.prompt == conversation["messages"][:1] and c.turns == conversation["messages"][1:]
    user, assistant = conversation["messages"]
    for bad in ({"messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]}, assistant]},
                {"messages": [user, {"role": "assistant", "content": [{"type": "shell", "text": "ls"}]}]},
                {"messages": [user, {"content": assistant["content"]}]}):
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps(bad) + "\n")
        with pytest.raises(InputError, match=r"bad.jsonl:1: field .messages."):
            load_conversations(path)


@pytest.mark.parametrize("row,field", [
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": []}]}, "messages"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "text", "text": " "}, {"type": "python_output", "text": "4"}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]}, "messages"),
    ({"question": "q", "answer": ""}, "answer"),
])
def test_an_empty_reply_is_refused_at_load_naming_the_row_and_field(tmp_path, row, field):
    """SFT learns the reply: one with nothing to learn (no parts, blank text, only a tool's output, which is masked)
    would train on <|assistant_end|> alone."""
    path = tmp_path / "sft.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(InputError, match=rf"sft.jsonl:2: field '{field}': (the assistant reply is|missing or) empty"):
        load_conversations(path)
