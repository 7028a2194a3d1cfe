"""How a model writes a tool call, and how one is read back out of a finished assistant turn.

- `nanochat`: nanochat's python blocks, inside the turn: `<|python_start|>expr<|python_end|>`, answered at once with
  `<|output_start|>answer<|output_end|>` forced into the same turn (engine/forcing.py). A block that reads
  `name(arguments)`, a call of one of your tools with literal arguments (`multiply(12, 34)`, `search(query="cats")`),
  calls it; anything else goes to the calculator where it is on, as in nanochat.
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call, then the end of the turn
  (Qwen2.5, Hermes, and the format given to a model whose template knows no tools). The results come
  back as `tool` turns rendered by the chat template, then the assistant's next turn opens.
- `llama3_json`: the whole turn is one JSON object `{"name": ..., "parameters": {...}}` (Llama 3.1-3.3's custom
  tool calls, `<|python_tag|>` before it allowed); results as `tool` turns (the template writes them as `ipython`).
"""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any

FORMATS = ("auto", "nanochat", "hermes", "llama3_json")
TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
# What reading text the model wrote may raise: JSON's and ast's errors, a NUL byte (ValueError), an unhashable
# literal ({[1]: 2}: TypeError), nesting past the parser's depth (RecursionError, MemoryError).
UNREADABLE = (ValueError, TypeError, SyntaxError, RecursionError, MemoryError)


@dataclass(frozen=True)
class Call:
    """One tool call as the model wrote it: the tool's name and its arguments, or why it could not be read."""
    name: str
    arguments: Any = None
    problem: str | None = None


def hermes_calls(text: str) -> list[Call]:
    """Every `<tool_call>` block of a turn, in order (an unclosed last one too: its JSON decides)."""
    return [json_call(body.strip(), "arguments") for body, _ in TOOL_CALL.findall(text)]


def llama3_calls(text: str) -> list[Call]:
    """The turn's one call where the whole turn is a JSON object with a name (none otherwise: a plain answer)."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return []
    call = json_call(body, "parameters")
    return [] if call.problem and call.name == "?" else [call]


def json_call(body: str, key: str) -> Call:
    """{"name": str, key: {...}} (also "arguments" for "parameters", and arguments given as a JSON string)."""
    try:
        obj = json.loads(body)
    except UNREADABLE as e:
        return Call("?", problem=f"the tool call is not JSON ({getattr(e, 'msg', type(e).__name__)})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return Call("?", problem="the tool call must be a JSON object with a \"name\"")
    arguments = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(arguments, str):  # OpenAI's wire form: the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except UNREADABLE as e:
            return Call(obj["name"], problem=f"its arguments are not JSON ({getattr(e, 'msg', type(e).__name__)})")
    return Call(obj["name"], arguments)


def block_call(text: str, params: dict[str, list[str]]) -> Call | None:
    """A nanochat python block that calls one of your tools (params: each tool's parameter names, in order),
    `name(arguments)` with literal arguments, positional ones in the order of the tool's parameters; None where the
    block names none of them (the calculator's)."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except UNREADABLE:
        return None
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in params):
        return None
    name, names = node.func.id, params[node.func.id]
    if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
        return Call(name, problem="write each argument out: no *args or **kwargs")
    try:
        args = [ast.literal_eval(a) for a in node.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    except UNREADABLE:
        return Call(name, problem="its arguments must be literals (numbers, strings, lists, dicts)")
    if len(args) > len(names):
        return Call(name, problem=f"{name} takes {len(names)} arguments, got {len(args)}")
    twice = [k for k in names[:len(args)] if k in kwargs]
    if twice:
        return Call(name, problem=f"{name} got argument {twice[0]} twice")
    return Call(name, {**dict(zip(names, args)), **kwargs})


def write_call(fmt: str, name: str, arguments: dict) -> str:
    """A tool call as a model writes it in the format (for a template that does not write tool calls itself)."""
    if fmt == "llama3_json":
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"


def template_format(template: str | None) -> str | None:
    """The call format a chat template writes (hermes or llama3_json), or None where it writes none."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return None


def renders_tools(template: str | None) -> bool:
    """Whether a chat template reads the `tools` it is given (else the tools are described in a system turn)."""
    return bool(template) and re.search(r"\btools\b", template) is not None


def tools_system_prompt(fmt: str, schemas: list[dict]) -> str:
    """The system turn that teaches a model whose template renders no tools the format it is given."""
    listed = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    if fmt == "llama3_json":
        how = ('To call a function, answer with only a JSON object {"name": function name, "parameters": its '
               "arguments} and end your turn.")
    else:
        how = ("To call a function, write its name and arguments as JSON inside <tool_call></tool_call> tags and end "
               'your turn:\n<tool_call>\n{"name": "<function name>", "arguments": {<arguments>}}\n</tool_call>')
    return (f"You can call these functions, described as JSON schemas:\n{listed}\n{how}\nEach result comes back in a "
            f"tool turn.")
