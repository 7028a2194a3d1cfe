"""SFT's conversations, read and checked: the turns before the last user turn are the prompt, and everything after
it (the assistant's turns, with the tool calls they make and the tool turns that answer them) is what SFT learns.

A record is {messages: [...]} (docs/data.md) or a GSM8K row {question, answer}, whose worked answer becomes a reply
with nanochat's calculator calls as parts. An assistant turn's content is a string, or nanochat's parts (the
reply of a conversation for a nanochat tokenizer: text, python and python_output parts); its tool calls, as
transformers writes them, `tool_calls: [{"type": "function", "function": {"name", "arguments": {...}}}]` (the
arguments may be a JSON string; a bare {"name", "arguments"} is read too).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from nanochat_ext.data.gsm8k import answer_parts, is_gsm8k_row
from nanochat_ext.data.rows import ROLES as CHAT_ROLES
from nanochat_ext.data.rows import answer_text, read_rows
from nanochat_ext.errors import InputError

ROLES = (*CHAT_ROLES, "tool")  # a conversation to learn may hold tool turns
PART_TYPES = ("text", "python", "python_output")
Message = dict


@dataclass(frozen=True)
class Conversation:
    prompt: list[Message]  # through the last user turn
    turns: list[Message]  # what is learnt: the assistant's turns after it, with the tool turns between them
    line: int


def load_conversations(path: str | os.PathLike) -> list[Conversation]:
    """Every conversation of the file, checked; the first bad one is one line naming the file, row and field."""
    out = []
    for lineno, obj in read_rows(path):
        if is_gsm8k_row(obj):  # GSM8K: the question, then its worked answer with calculator calls as parts
            if not isinstance(obj["question"], str) or not isinstance(obj["answer"], str):
                raise InputError("question and answer must be strings", str(path), lineno, "answer")
            reply = reply_to_learn(answer_parts(obj["answer"]), str(path), lineno, "answer")
            out.append(Conversation([{"role": "user", "content": obj["question"]}],
                                    [{"role": "assistant", "content": reply}], lineno))
            continue
        out.append(conversation(obj.get("messages"), str(path), lineno))
    if not out:
        raise InputError("no conversations in file", path=str(path))
    return out


def conversation(value: object, path: str, line: int) -> Conversation:
    """One {messages} record split where the learnt turns begin (after the last user turn)."""
    messages = [message(m, i, path, line) for i, m in enumerate(value)] if isinstance(value, list) and value else None
    if not messages:
        raise InputError("expected a non-empty list of messages", path, line, "messages")
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    first = users[-1] + 1 if users else len(messages)
    turns = messages[first:]
    if not turns or turns[0]["role"] != "assistant" or turns[-1]["role"] != "assistant":
        raise InputError("must end with a user turn followed by the assistant's reply (tool turns between its turns)",
                         path, line, "messages")
    if any(isinstance(m["content"], list) for m in messages[:first]) or (
            len(turns) > 1 and any(isinstance(m["content"], list) for m in turns)):
        raise InputError("nanochat's parts (a list of {type, text}) go only in a conversation's one reply", path, line,
                         "messages")
    for m in turns:
        if m["role"] == "assistant" and not m.get("tool_calls"):
            if isinstance(m["content"], list):
                reply_to_learn(m["content"], path, line, "messages")
            else:
                answer_text(m["content"], path, line, "messages")
    return Conversation(messages[:first], turns, line)


def message(m: object, i: int, path: str, line: int) -> Message:
    """A message as transformers' chat templates take it; tool calls in transformers' form."""
    parts = isinstance(m, dict) and m.get("role") == "assistant" and isinstance(m.get("content"), list)
    calls = m.get("tool_calls") if isinstance(m, dict) else None
    content = m.get("content") if isinstance(m, dict) else None
    if not isinstance(m, dict) or m.get("role") not in ROLES or not (
            parts or isinstance(content, str) or (content is None and calls)):
        raise InputError(f"message {i} must be {{'role': {'|'.join(ROLES)}, 'content': str}}", path, line, "messages")
    if parts:
        for k, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") in PART_TYPES and isinstance(part.get("text"), str)):
                raise InputError(f"reply part {k} must be {{'type': text|python|python_output, 'text': str}}",
                                 path, line, "messages")
    out = {"role": m["role"], "content": content if content is not None else ""}
    if calls is not None:
        if m["role"] != "assistant" or not isinstance(calls, list) or not calls:
            raise InputError(f"message {i}: tool_calls must be a non-empty list, on an assistant turn", path, line,
                             "messages")
        out["tool_calls"] = [tool_call(c, i, path, line) for c in calls]
    return out


def tool_call(c: object, i: int, path: str, line: int) -> dict:
    """{"type": "function", "function": {"name": str, "arguments": dict}} from either form transformers reads."""
    fn = c.get("function", c) if isinstance(c, dict) else None
    arguments = fn.get("arguments", {}) if isinstance(fn, dict) else None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(arguments, dict):
        raise InputError(f"message {i}: a tool call must be {{'function': {{'name': str, 'arguments': {{...}}}}}}",
                         path, line, "messages")
    return {"type": "function", "function": {"name": fn["name"], "arguments": arguments}}


def reply_to_learn(parts: list[dict], path: str, line: int, field: str) -> list[dict]:
    """A reply given as parts, refused when it holds nothing to train on (no parts, or only blank ones and tool
    outputs, which SFT leaves out of the loss): it would teach the end of the turn alone."""
    if not any(p["type"] != "python_output" and p["text"].strip() for p in parts):
        raise InputError("the assistant reply is empty (no text or tool call to learn)", path, line, field)
    return parts
