"""Rollouts as conversations: the run's tools and environment (`Agent`), and one generate call's episodes
(`Episodes`), which the engine asks what to force into a row when the row closes a python block (nanochat's tool
protocol, inside a turn) or ends an assistant turn (a tool call in a chat template's format, or an environment's
next message). Whatever is forced is rendered as the model's own tokenizer or chat template writes it, and is left
out of the loss (mask 0); the turn-ending token the model sampled is in it.

A rollout ends when a turn asks for nothing more (no tool call; the environment answers None), after --max_turns
assistant turns, or when --max_new_tokens, the budget of the whole rollout (forced tokens included), runs out.
"""
from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nanochat_ext.agent.calculator import calculate
from nanochat_ext.agent.formats import (
    FORMATS,
    Call,
    block_call,
    hermes_calls,
    llama3_calls,
    renders_tools,
    template_format,
    tools_system_prompt,
    write_call,
)
from nanochat_ext.agent.toolbox import (
    MAX_LATE_CALLS,
    LateCalls,
    Outcome,
    Tool,
    argument_problem,
    call_all,
    load_env_factory,
    load_tools,
)
from nanochat_ext.config import FINITE_POSITIVE, POSITIVE, option
from nanochat_ext.engine.forcing import ToolState, ToolTokens
from nanochat_ext.errors import InputError, first_line
from nanochat_ext.tokenizer import Message, TokenizerWrapper

BUILT_IN = ("calculator", "none")
ROLES = ("user", "tool")  # the turns an environment may answer with


@dataclass(frozen=True)
class AgentConfig:
    """The tools and the environment a policy's rollouts (and its evaluations) run with."""
    tools: str | None = option(None, "tools the policy may call, comma-separated: calculator (nanochat's, in "
                                     "<|python_start|> blocks), module:function (your own, typed and documented: "
                                     "docs/tools.md), or none; default: calculator where the tokenizer has nanochat's "
                                     "python tokens, else none")
    tool_format: str = option("auto", "how tool calls are written: nanochat (python blocks, answered inside the turn), "
                                      "hermes (<tool_call>{json}</tool_call>, answered in a tool turn) or llama3_json; "
                                      "auto: nanochat for a nanochat tokenizer, else the chat template's own, else "
                                      "hermes", choices=FORMATS)
    tool_timeout: float = option(10.0, "seconds a tool or environment call may take; past it the row reads an error "
                                       "(and an environment's episode ends, reward 0)", type=float,
                                 check=FINITE_POSITIVE)
    max_late_calls: int = option(MAX_LATE_CALLS, "tool and environment calls still running past --tool_timeout that a "
                                     "rank keeps (Python cannot stop a thread); once this many are, new calls are "
                                     "refused, an error the row reads", type=int, check=POSITIVE)
    max_tool_calls: int = option(8, "tool calls an assistant turn may make (python blocks, or calls in a chat "
                                    "format's turn); the rest are refused, an error the row reads", type=int,
                                 check=POSITIVE)
    env: str | None = option(None, "module:factory: a multi-turn environment, made per rollout from the prompt's row, "
                                   "that answers each finished assistant turn (docs/tools.md)")
    max_turns: int = option(8, "assistant turns per rollout at most, tool-call turns included", type=int,
                            check=POSITIVE)


class Agent:
    """The tools and the environment of a run, as its tokenizer speaks them. `python`: the ids of nanochat's block
    tokens where calls are python blocks (the engine tracks blocks on the device), else None; `turns`: whether a row
    may go on after it ends a turn."""

    def __init__(self, cfg: AgentConfig, tok: TokenizerWrapper, first_row: dict | None = None):
        self.cfg, self.tok = cfg, tok
        self.late = LateCalls()  # this run's calls still running past their timeout: not an earlier run's
        names = [s.strip() for s in (cfg.tools or "").split(",") if s.strip()]
        self.protocol = ToolTokens.of(tok)
        self.calculator = "calculator" in names or (cfg.tools is None and self.protocol is not None)
        self.tools: dict[str, Tool] = {t.name: t for t in load_tools([n for n in names if n not in BUILT_IN])}
        if "none" in names and len(names) > 1:
            raise InputError(f"--tools {cfg.tools!r}: none goes alone")
        self.spec = ",".join(["calculator"] * self.calculator + [n for n in names if n not in BUILT_IN]) or "none"
        self.format = self._format(cfg.tool_format)
        if self.format == "nanochat" and self.tool_names and self.protocol is None:
            raise InputError(f"--tools {','.join(self.tool_names)} in nanochat's "
                             f"format needs its <|python_start|> and <|output_start|> tokens, which the tokenizer "
                             f"({tok.source}) does not have; with a chat model, --tool_format hermes or llama3_json")
        if self.calculator and self.format != "nanochat":
            raise InputError(f"--tools calculator runs in nanochat's python blocks, not in the {self.format} format: "
                             f"give your own calculator as a tool (docs/tools.md)")
        self.python = (self.protocol.python_start, self.protocol.python_end) \
            if self.format == "nanochat" and self.tool_names else None
        self.factory = load_env_factory(cfg.env) if cfg.env else None
        self.factory_args = {}
        if self.factory is not None and "time_limit" in parameters(self.factory):
            # the sandbox's own clock inside the call's, a second short for its end and the verdict (its slot's wait
            # and its start are not the call's time: runtime/waits.py)
            self.factory_args["time_limit"] = max(cfg.tool_timeout - 1.0, cfg.tool_timeout / 2)
        self.env_reward = self.factory is not None and callable(getattr(self._probe(first_row or {}), "get_reward",
                                                                         None))
        self.turns = self.factory is not None or (bool(self.tools) and self.format != "nanochat")
        self.schemas = [t.schema for t in self.tools.values()]
        # The template describes the tools only where it writes calls in the run's format (else a system turn does).
        # With no tools, none (not []: Llama 3's template tests `tools is not none`) and the prompts are the
        # template's own.
        self._template_tools = bool(self.tools) and renders_tools(tok.chat_template) and \
            template_format(tok.chat_template) == self.format
        for role in (["tool"] if self.turns and self.tools else []) + (["user"] if self.factory else []):
            self.followup([{"role": role, "content": "1"}])  # a template that cannot render the turn: one line now

    @property
    def tool_names(self) -> list[str]:
        return ["calculator"] * self.calculator + list(self.tools)

    @property
    def active(self) -> bool:
        return self.python is not None or self.turns

    def _format(self, asked: str) -> str:
        if asked != "auto":
            return asked
        if self.tok.kind == "rustbpe":
            return "nanochat"
        return template_format(self.tok.chat_template) or "hermes"

    def make_env(self, row: dict) -> Any:
        """A rollout's environment, from a copy of its row: a factory that changes the row changes no other."""
        return self.factory(copy.deepcopy(row), **self.factory_args)

    def _probe(self, row: dict) -> Any:
        """One environment made at the start, from the first prompt's row: a factory that fails is one line now."""
        try:
            env = self.make_env(row)
        except Exception as e:  # the user's code
            raise InputError(f"--env {self.cfg.env!r}: the factory raised {first_line(e)} on the first prompt's "
                             f"row") from None
        if not callable(getattr(env, "step", None)):
            raise InputError(f"--env {self.cfg.env!r}: what the factory returns has no step(reply) method")
        return env

    def describe(self) -> str:
        """The log's line of what the rollouts run with."""
        tools = self.tool_names
        where = ("in nanochat's python blocks" if self.format == "nanochat" else
                 f"in the {self.format} format, " + ("the chat template renders them" if self._template_tools
                                                     else "described in a system turn (the template renders none)"))
        parts = [f"tools: {', '.join(tools)} {where}" if tools else "tools: none"]
        if self.factory:
            parts.append(f"environment: {self.cfg.env}" + (" (it gives a reward)" if self.env_reward else ""))
            if callable(getattr(self.factory, "describe", None)):  # e.g. code_tests: what isolation its code gets
                parts.append(str(self.factory.describe()))
        if self.turns:
            parts.append(f"at most {self.cfg.max_turns} turns, tool timeout {self.cfg.tool_timeout:g} s")
        return "; ".join(parts)

    @property
    def template_tools(self) -> list[dict] | None:
        """The tools' schemas for a chat template that renders them (None where the agent describes them itself)."""
        return self.schemas if self._template_tools else None

    def render_prompt(self, messages: list[Message]) -> list[int]:
        """A prompt as the rollouts see it: with the tools' schemas where the format puts them."""
        return self.tok.render_prompt(self.for_template(messages), self.template_tools)

    def for_template(self, messages: list[Message]) -> list[Message]:
        """A conversation as this run renders it: the tools described in a system turn where the template renders
        none, and tool calls written out in the format where the template does not write them (SFT's data)."""
        if self.tools and not self._template_tools:
            about = self._block_prompt() if self.format == "nanochat" else tools_system_prompt(self.format,
                                                                                               self.schemas)
            if messages[0]["role"] == "system":
                messages = [{"role": "system", "content": about + "\n\n" + messages[0]["content"]}, *messages[1:]]
            else:
                messages = [{"role": "system", "content": about}, *messages]
        if self._template_tools and "tool_calls" in self.tok.chat_template:
            return messages  # the template writes tool calls itself, in the run's format
        return [{"role": m["role"], "content": "\n".join(filter(None, [m["content"], *(
                    write_call(self.format, c["function"]["name"], c["function"]["arguments"])
                    for c in m["tool_calls"])]))} if m.get("tool_calls") else m for m in messages]

    def _block_prompt(self) -> str:
        listed = "\n".join(f"{t.name}({', '.join(t.parameters.get('properties', {}))}): "
                           f"{t.schema['function']['description']}" for t in self.tools.values())
        return f"You can call these tools in a python block, as name(arguments):\n{listed}"

    def followup(self, messages: list[Message]) -> list[int]:
        return self.tok.render_followup(messages, self.template_tools)

    def episodes(self, rows: list[dict], group: int) -> Episodes:
        return Episodes(self, rows, group)

    def call(self, calls: list[Call]) -> list[Outcome]:
        """Every call's outcome, all at once within the timeout; a call that did not parse or whose arguments do not
        fit its tool is an error outcome without running anything."""
        runnable, outcomes = [], [None] * len(calls)
        for i, c in enumerate(calls):
            tool = self.tools.get(c.name)
            problem = c.problem or (f"there is no tool {c.name!r} (tools: {', '.join(self.tools)})" if tool is None
                                    else argument_problem(tool, c.arguments))
            if problem:
                outcomes[i] = Outcome(f"Error: {problem}", True)
            else:
                runnable.append((i, (f"tool {c.name}", lambda fn=tool.fn, a=c.arguments: fn(**a))))
        for (i, _), outcome in zip(runnable, self.call_all([thunk for _, thunk in runnable])):
            outcomes[i] = outcome
        return outcomes

    def call_all(self, calls: list, text: bool = True) -> list[Outcome]:
        return call_all(calls, self.cfg.tool_timeout, text, self.cfg.max_late_calls, self.late)

    def refused(self) -> Outcome:
        return Outcome(f"Error: at most {self.cfg.max_tool_calls} tool calls a turn (--max_tool_calls); this one was "
                       f"not run", True)


def parameters(factory: Any) -> set[str]:
    """The keyword parameters a factory (a class or a function) takes."""
    try:
        return set(inspect.signature(factory).parameters)
    except (TypeError, ValueError):
        return set()


class Episodes:
    """One generate call's rollouts as episodes: each row's environment (made from its prompt's row), its turns so
    far, and the counts the logs show (tool calls, errors and timeouts; environment errors and timeouts). An
    environment whose call timed out or was refused is ended: never stepped again (a late answer is dropped), its
    reward 0."""

    def __init__(self, agent: Agent, rows: list[dict], group: int):
        self.agent, self.rows, self.group = agent, rows, group
        n = len(rows) * group
        self.turns = [1] * n
        self.turn_start = [0] * n  # where each row's current assistant turn begins in its completion
        self.turn_calls = [0] * n  # tool calls in each row's current turn
        self.tool_calls = self.tool_errors = self.tool_timeouts = self.env_errors = self.env_timeouts = 0
        self.envs: list[Any] = [None] * n
        if agent.factory is not None:
            made = agent.call_all([(f"the --env factory on row {r}", lambda row=rows[r // group]: agent.make_env(row))
                                   for r in range(n)], text=False)
            self.envs = [None if o.error else o.value for o in made]
            self.env_errors = sum(o.error for o in made)
            self.env_timeouts = sum(o.timed_out for o in made)

    def after_step(self, t: int, out: torch.Tensor, lengths: torch.Tensor, done: torch.Tensor, tools: ToolState,
                   of: Callable[[list[int]], list[int]]) -> tuple[bool, int]:
        """The engine's hook after token t (engine.StepHook): in one read from the device, how many rows have stopped
        and whether all have; the python blocks token t closed answered, and the rows whose token t ended a turn
        asked for their next one (forced into the row, which decodes on). `of`: the call's rows of rows of the
        current batch, after the engine shrank it."""
        ended = done & (lengths == t + 1)
        stopped, closed, any_ended = torch.stack([done.sum(), tools.closed.any(), ended.any()]).tolist()
        finished, room = stopped == done.numel(), out.size(1) - t - 1  # room: tokens left after token t
        if closed and not finished and room:
            rows, blocks = tools.closed_blocks(out, t)
            for row, ids in zip(rows, self.answer_blocks([self.agent.tok.decode(b) for b in blocks], of(rows))):
                tools.queue(row, ids)
        if any_ended and self.agent.turns:
            rows = ended.nonzero().squeeze(1).tolist()
            calls = of(rows)  # the episodes' rows
            texts = [self.agent.tok.turn_text(out[row, self.turn_start[call]:t].tolist())
                     for row, call in zip(rows, calls)]
            for row, call, ids in zip(rows, calls, self.after_turns(calls, texts, room)):
                if ids:
                    tools.queue(row, ids[:room])
                    done[row], lengths[row] = False, out.size(1)
                    self.turn_start[call] = min(t + 1 + len(ids), out.size(1))
                    tools.in_block[row] = False  # a block the ended turn left open is not the next turn's
                    finished, stopped = False, stopped - 1
        return finished, stopped

    def _tools(self, calls: list[Call | None], rows: list[int]) -> list[Outcome | None]:
        """Each call's outcome (None for a block that calls no tool); a row's calls past --max_tool_calls in its
        turn are refused, not run."""
        cap, run = self.agent.cfg.max_tool_calls, []
        for c, row in zip(calls, rows):
            self.turn_calls[row] += c is not None
            run.append(c is not None and self.turn_calls[row] <= cap)
        outcomes = iter(self.agent.call([c for c, go in zip(calls, run) if go]))
        out = [None if c is None else next(outcomes) if go else self.agent.refused() for c, go in zip(calls, run)]
        self.tool_timeouts += sum(o is not None and o.timed_out for o in out)
        return out

    def answer_blocks(self, blocks: list[str], rows: list[int]) -> list[list[int]]:
        """What is forced after each closed python block (its text; rows: whose blocks they are): a call of one of
        your tools answered inside <|output_start|>..<|output_end|>, errors too; anything else the calculator's
        answer, or nothing where it refuses (nanochat's Engine, token for token)."""
        a, p = self.agent, self.agent.protocol
        params = {name: list(t.parameters.get("properties", {})) for name, t in a.tools.items()}
        calls = [block_call(text, params) for text in blocks]
        outcomes = self._tools(calls, rows)
        forced = []
        for text, c, outcome in zip(blocks, calls, outcomes):
            if c is not None:
                answer = outcome
            elif a.calculator:
                value = calculate(text)
                answer = Outcome(value, False) if value is not None else None
            else:
                answer = Outcome(f"Error: not a call of a tool, name(arguments) (tools: {', '.join(a.tools)})", True)
            self.tool_calls += 1
            self.tool_errors += answer is None or answer.error
            forced.append([] if answer is None else [p.output_start, *p.tok.encode(answer.text), p.output_end])
        return forced

    def after_turns(self, rows: list[int], texts: list[str], room: int) -> list[list[int] | None]:
        """For each row that ended an assistant turn (its text, the turn-ending token left out): the ids to force
        before its next turn, or None where its episode ends. room: tokens left in the rollouts' budget. The
        environment sees every finished turn, the last one too (at --max_turns, or with no room left), so that its
        state, and its reward, follow the whole episode."""
        a = self.agent
        out: list[list[int] | None] = [None] * len(rows)
        more = [room > 0 and self.turns[r] < a.cfg.max_turns for r in rows]
        calls = [self._calls(text) for text in texts]
        tool_rows = [k for k in range(len(rows)) if calls[k] and more[k]]  # a call with no turn left goes unanswered
        outcomes = iter(self._tools([c for k in tool_rows for c in calls[k]],
                                    [rows[k] for k in tool_rows for _ in calls[k]]))
        for k in tool_rows:
            results = [next(outcomes) for _ in calls[k]]
            self.tool_calls += len(results)
            self.tool_errors += sum(o.error for o in results)
            out[k] = self._followup([{"role": "tool", "content": o.text} for o in results], "tool_errors")
        env_rows = [k for k in range(len(rows)) if not calls[k] and self.envs[rows[k]] is not None]
        answers = a.call_all([(f"the environment's step on row {rows[k]}",
                               lambda env=self.envs[rows[k]], text=texts[k]: env.step(text)) for k in env_rows],
                             text=False)
        for k, answer in zip(env_rows, answers):
            if answer.timed_out or answer.refused:  # ended: its late step may still change it
                self.envs[rows[k]] = None
                self.env_errors += 1
                self.env_timeouts += answer.timed_out
                continue
            messages = self._env_messages(answer)
            out[k] = self._followup(messages, "env_errors") if messages and more[k] else None
        for k, forced in enumerate(out):
            self.turns[rows[k]] += forced is not None
            self.turn_calls[rows[k]] = 0
        return out

    def _followup(self, messages: list[Message], count: str) -> list[int] | None:
        """The turns' ids to force, or None (the episode ends, one more of `count`: tool_errors or env_errors) where
        the chat template refuses them, e.g. two user turns in a row where it demands that turns alternate."""
        try:
            return self.agent.followup(messages)
        except InputError:
            setattr(self, count, getattr(self, count) + 1)
            return None

    def _calls(self, text: str) -> list[Call]:
        a = self.agent
        if not a.tools or a.format == "nanochat":
            return []
        return hermes_calls(text) if a.format == "hermes" else llama3_calls(text)

    def _env_messages(self, answer: Outcome) -> list[Message] | None:
        """An environment's answer as the turns to render: a string is a user turn, {role, content} a turn, a list
        of them turns, None (or []) the end; anything else, or a failure, an error the model reads as a user turn
        (counted)."""
        if answer.error:
            self.env_errors += 1
            return [{"role": "user", "content": answer.text}]
        if answer.value is None or (isinstance(answer.value, list) and not answer.value):
            return None
        turns = [answer.value] if isinstance(answer.value, (str, dict)) else answer.value
        if isinstance(turns, list) and turns:
            turns = [{"role": "user", "content": t} if isinstance(t, str) else t for t in turns]
            if all(isinstance(t, dict) and t.get("role") in ROLES and isinstance(t.get("content"), str) for t in turns):
                return [{"role": t["role"], "content": t["content"]} for t in turns]
        self.env_errors += 1
        return [{"role": "user", "content": f"Error: the environment answered {type(answer.value).__name__} "
                                            f"{str(answer.value)[:60]!r}, not a message"}]

    def env_rewards(self) -> list[Outcome]:
        """Each row's get_reward() once its episode is over (an error Outcome where it failed): the rewards check
        the values as a reward function's. A row whose environment could not be made or was ended (counted in
        env_errors), or whose get_reward timed out or was refused (counted too), has reward 0."""
        got = iter(self.agent.call_all([("the environment's get_reward", lambda env=env: env.get_reward())
                                        for env in self.envs if env is not None], text=False))
        out = []
        for env in self.envs:
            outcome = Outcome("", False, 0.0) if env is None else next(got)
            if outcome.timed_out or outcome.refused:
                self.env_errors += 1
                self.env_timeouts += outcome.timed_out
                outcome = Outcome("", False, 0.0)
            out.append(outcome)
        return out
