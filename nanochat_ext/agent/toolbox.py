"""Your own tools and environments inside rollouts: what `--tools module:fn` and `--env module:factory` load, and how
they are called so that nothing they do can stop a run.

A tool is a plain Python function with type hints and a docstring (Google style: `Args:` naming each argument), as
transformers and TRL take them: its JSON schema is transformers' own `get_json_schema`, which is what a chat template
renders into the prompt. An environment is made per rollout by a factory called with a copy of the prompt's row (the
whole JSON object); docs/tools.md defines what it answers.

Every call runs in a thread of its own, all of one decode step's calls at once, each given --tool_timeout seconds of
its own time: what it waits for other calls (a sandbox's slot, runtime/waits.py) is not counted.
Whatever a call does (raises, returns something that is not text or JSON, takes too long, cannot be started) becomes
an error observation for its row: the text the model is shown, counted as an error in the logs. A call that overruns
is abandoned, not stopped (Python cannot stop a thread): it stays counted among the process's late calls until it
ends, and once --max_late_calls of them are running, new calls are refused (an error the row reads) rather than
piling up threads. Code that may loop forever belongs in a subprocess, as the code-tests environment
(tasks/code_tests.py) runs the model's code in sandbox/sandbox.py.
"""
from __future__ import annotations

import importlib
import inspect
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nanochat_ext.errors import InputError, first_line
from nanochat_ext.runtime.waits import Waits

MAX_OUTPUT_CHARS = 4000  # an answer longer than this is cut, and says so
MAX_LATE_CALLS = 64  # --max_late_calls' default
JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict}


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable
    schema: dict  # {"type": "function", "function": {name, description, parameters}}, as transformers writes it

    @property
    def parameters(self) -> dict:
        return self.schema["function"]["parameters"]


@dataclass(frozen=True)
class Outcome:
    """What one call gave: the text the model reads, whether it was an error (and an overrun), and its value (what it
    raised, for an error)."""
    text: str
    error: bool = False
    value: Any = None
    timed_out: bool = False
    refused: bool = False  # not run: too many calls still running past their timeout


class LateCalls:
    """This process's calls still running past their timeout: Python cannot stop a thread, so they are counted
    until they end, and new calls are refused once `cap` are running."""

    def __init__(self):
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()

    def add(self, thread: threading.Thread) -> None:
        with self.lock:
            self.threads.append(thread)

    def count(self) -> int:
        with self.lock:
            self.threads = [t for t in self.threads if t.is_alive()]
            return len(self.threads)


LATE = LateCalls()


def load_attribute(spec: str, flag: str) -> Callable:
    """The callable `module:name` names, importable from the working directory or $PYTHONPATH; one line naming the
    flag where it is not."""
    module_name, sep, name = spec.rpartition(":")
    if not sep or not module_name or not name:
        raise InputError(f"{flag} {spec!r}: give module:function (e.g. mytools:search)")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # the user's module: any failure to import it is the run's one line
        raise InputError(f"{flag} {spec!r}: cannot import {module_name!r} ({first_line(e)})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise InputError(f"{flag} {spec!r}: {module_name} has no function {name!r}")
    return fn


def load_tool(spec: str) -> Tool:
    """A --tools entry: the function and its schema; one line where it has no docstring or an argument no type."""
    from transformers.utils import get_json_schema

    fn = load_attribute(spec, "--tools")
    try:
        schema = get_json_schema(fn)
    except Exception as e:  # transformers' DocstringParsingException, TypeHintParsingException, ...
        raise InputError(f"--tools {spec!r}: {first_line(e)} (a tool needs a type hint on every argument and a "
                         f"docstring with an Args: section, as transformers' get_json_schema reads it)") from None
    return Tool(fn.__name__, fn, schema)


def load_tools(specs: list[str]) -> list[Tool]:
    tools = [load_tool(spec) for spec in specs]
    names = [t.name for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise InputError(f"--tools names {twice[0]!r} twice: tool names must differ")
    return tools


def argument_problem(tool: Tool, arguments: Any) -> str | None:
    """Why the arguments a model wrote do not fit the tool's schema (None: they do): not an object, a required one
    missing, an unknown one, or a value of another JSON type."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {shown(arguments)[:80]}"
    params = tool.parameters.get("properties", {})
    missing = [a for a in tool.parameters.get("required", []) if a not in arguments]
    unknown = [a for a in arguments if a not in params]
    if missing or unknown:
        return (f"{tool.name} takes {', '.join(params) or 'no arguments'}"
                + (f"; missing {', '.join(missing)}" if missing else "")
                + (f"; unknown {', '.join(unknown)}" if unknown else ""))
    for name, value in arguments.items():
        problem = value_problem(params[name], value)
        if problem:
            return f"argument {name} {problem}"
    return None


def value_problem(schema: dict, value: Any) -> str | None:
    """Why a value does not fit its JSON schema (its type, `enum`, an array's `items`), or None."""
    types = schema.get("type")  # a name, or a list of names for a union (int | str)
    types = types if isinstance(types, list) else [types]
    if value is None and schema.get("nullable"):  # transformers writes `int | None` as nullable
        return None
    if all(t in JSON_TYPES for t in types) and not any(of_json_type(value, t) for t in types):
        return f"must be {' or '.join(map(str, types))}, got {shown(value)[:40]}"
    if isinstance(schema.get("enum"), list) and value not in schema["enum"]:
        return f"must be one of {shown(schema['enum'])[:80]}, got {shown(value)[:40]}"
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for k, item in enumerate(value):
            problem = value_problem(schema["items"], item)
            if problem:
                return f"item {k} {problem}"
    return None


def shown(value: Any) -> str:
    """A value the model wrote, as its error message shows it: JSON, or Python's repr where JSON has no form (a set,
    bytes, a tuple as a key: nanochat's python blocks can write them)."""
    try:
        return json.dumps(value, ensure_ascii=False, default=repr)
    except (TypeError, ValueError):
        return repr(value)


def of_json_type(value: Any, name: str) -> bool:
    """Whether a value the model wrote is of the JSON schema type `name` (true and false are no numbers)."""
    kind = JSON_TYPES.get(name)
    return kind is not None and isinstance(value, kind) and (not isinstance(value, bool) or kind is bool)


def as_text(value: Any) -> str:
    """A tool's or an environment's answer as the text the model reads: a string as it is, anything JSON can write
    as JSON; TypeError for anything else."""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError):
            raise TypeError(f"returned {type(value).__name__}, not text or JSON") from None
    return text if len(text) <= MAX_OUTPUT_CHARS else text[:MAX_OUTPUT_CHARS] + " ...(cut)"


def call_all(calls: list[tuple[str, Callable[[], Any]]], timeout: float, text: bool = True,
             max_late: int = MAX_LATE_CALLS, late_calls: LateCalls = LATE) -> list[Outcome]:
    """Run every call at once, each in a thread of its own, within `timeout` seconds of the start (calls: (what,
    thunk)). Each value kept, and as text where `text` (a value that has none is an error); every failure an error
    Outcome naming what failed. While `max_late` calls counted in `late_calls` (a run's own: Agent.late) are still
    running past their timeout, the calls are refused (an error Outcome) and not run."""
    late = late_calls.count()
    if calls and late >= max_late:
        return [Outcome(f"Error: {what} was not run: {late} earlier calls are still running past their timeout",
                        True, refused=True) for what, _ in calls]
    results: list[dict] = [{"waits": Waits()} for _ in calls]

    def run(thunk: Callable[[], Any], box: dict) -> None:
        box["waits"].attach()
        try:
            box["value"] = thunk()
        except BaseException as e:  # the user's code: whatever it raises is its row's observation
            box["error"] = e

    threads: list[threading.Thread | None] = []
    for (_, thunk), box in zip(calls, results):
        th = threading.Thread(target=run, args=(thunk, box), daemon=True)
        try:
            th.start()
        except RuntimeError as e:  # the OS refused a thread ("can't start new thread")
            box["unstarted"], th = first_line(e), None
        threads.append(th)
    deadline = time.monotonic() + timeout
    out = []
    for (what, _), th, box in zip(calls, threads, results):
        if th is None:
            out.append(Outcome(f"Error: {what} could not be started ({box['unstarted']})", True))
            continue
        while th.is_alive() and time.monotonic() < deadline + box["waits"].waited():  # waits for others: not its time
            th.join(max(deadline + box["waits"].waited() - time.monotonic(), 0.01))  # a wait moves it on
        if th.is_alive():
            late_calls.add(th)
            out.append(Outcome(f"Error: {what} did not answer within {timeout:g} s", True, timed_out=True))
        elif "error" in box:
            out.append(Outcome(f"Error: {what} raised {first_line(box['error'])}", True, box["error"]))
        elif not text:
            out.append(Outcome("", False, box["value"]))
        else:
            try:
                out.append(Outcome(as_text(box["value"]), False, box["value"]))
            except TypeError as e:
                out.append(Outcome(f"Error: {what} {e}", True))
    return out


def load_env_factory(spec: str) -> Callable[[dict], Any]:
    """--env module:factory: called with a prompt's row, it returns the environment of one rollout."""
    factory = load_attribute(spec, "--env")
    if inspect.isclass(factory) and not callable(getattr(factory, "step", None)):
        raise InputError(f"--env {spec!r}: {factory.__name__} has no step(reply) method")
    return factory
