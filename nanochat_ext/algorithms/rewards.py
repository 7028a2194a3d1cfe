"""GRPO's rewards: the reward model's score, rule-based reward functions, a remote reward service and the
environments' own rewards, each weighted, with DAPO's overlong penalty; checked and logged per reward.

A reward function is `module:function` (or a built-in's name: `gsm8k`, `exact_match`, ...), called
f(prompt, completion, row) -> float per completion, in a thread pool of --reward_workers (it must then be
thread-safe); or, with an attribute `batched = True`, once per step with this rank's lists, f(prompts, completions,
rows) -> a sequence of floats (batched, as TRL's reward functions are). A reward service (--reward_url) gets a rank's
completions of a step as one JSON POST, {"prompts": [...], "completions": [...], "rows": [...]}, and answers
{"rewards": [...]} (as OpenRLHF's remote RM does), within a timeout, retried with backoff. An --env whose
environments have get_reward() gives one more reward, each rollout's own. Every value passes the same checks (a
real, finite number within --reward_clip), and any failure is one line naming the function or the URL and the
prompt, raised on every rank; but a function or get_reward() that raises errors.Unscored (a sandbox that failed to
start: the machine's failure, not the answer's) gives NaN, and its completion's group is left out of the loss.
"""
from __future__ import annotations

import difflib
import http.client
import inspect
import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from nanochat_ext.agent.agent import Episodes
from nanochat_ext.agent.toolbox import load_attribute
from nanochat_ext.config import FINITE_POSITIVE, POSITIVE, option
from nanochat_ext.data.batching import truncate
from nanochat_ext.data.rows import PromptRow
from nanochat_ext.ddp_common import raise_if_any
from nanochat_ext.engine.engine import Samples
from nanochat_ext.errors import InputError, Unscored, first_line
from nanochat_ext.models.reward_model import RewardScorer, load_reward_model
from nanochat_ext.runtime.outdir import keep_traceback
from nanochat_ext.tasks import reward_fns
from nanochat_ext.tasks.reward_fns import BUILT_IN, REFERENCE, reference_problem
from nanochat_ext.tokenizer import TokenizerWrapper, same_ids

RewardFn = Callable[[str, str, dict], float]
URL_RETRIES = 3  # tries of a reward service call, 1 s then 2 s apart


@dataclass(frozen=True)
class RewardConfig:
    """GRPO's rewards: a reward model, rule-based reward functions and a reward service, each weighted."""
    rm: str | None = option(None, "reward-model checkpoint file, or a dir (its newest complete checkpoint), as written "
                                  "by kat_train_rm; optional when --reward_fn is given")
    rm_backbone: str | None = option(None, "the RM's backbone, where the RM cannot find it itself (it looks beside its "
                                           "own dir, under $NANOCHAT_BASE_DIR, then at the absolute path it recorded); "
                                           "refused if its weights differ from the ones the RM was trained on")
    reward_fn: list[str] = option(None, "rule-based reward 'module:function', called f(prompt, completion, row) -> "
                                        "float, or a built-in: " + ", ".join(BUILT_IN) + "; repeatable",
                                  action="append")
    reward_workers: int = option(1, "threads calling each per-completion --reward_fn (a judge or sandbox that waits on "
                                    "I/O); a function with `batched = True` is called once per step with lists "
                                    "instead", type=int, check=POSITIVE)
    reward_url: str | None = option(None, "a reward service: each rank POSTs its completions of a step as JSON "
                                          "{prompts, completions, rows} and reads {rewards: [...]} back; one more "
                                          "reward column, 'url'")
    reward_timeout: float = option(60.0, "seconds per --reward_url call, tried 3 times", type=float,
                                   check=FINITE_POSITIVE)
    reward_clip: float | None = option(None, "refuse (stop the run with the prompt named) a reward function value "
                                             "outside [-C, C]; NaN/inf and non-numbers are always refused", type=float,
                                       check=FINITE_POSITIVE)
    reward_weights: list[float] | None = option(None, "one weight per reward, in order: the RM (if --rm), each "
                                                      "--reward_fn, the service (if --reward_url), then the "
                                                      "environment's (an --env with get_reward) (default: all 1)",
                                                type=float, nargs="+")


def load_reward_fn(spec: str | RewardFn) -> RewardFn:
    """`package.module:function` (or a built-in's name, reward_fns.BUILT_IN) -> the callable; a callable (given in
    Python, nanochat_ext.api) is itself. Any failure to import the module (an ImportError, a SyntaxError, an
    exception its top level raises), a name that is neither a built-in nor module:function, and a function that
    cannot be called as a reward (check_signature) is one line."""
    if isinstance(spec, str) and spec in BUILT_IN:
        return getattr(reward_fns, spec)
    if isinstance(spec, str) and ":" not in spec:
        close = difflib.get_close_matches(spec, BUILT_IN, n=1, cutoff=0.6)
        guess = f" (did you mean {close[0]}?)" if close else ""
        raise InputError(f"--reward_fn {spec!r} is not a built-in reward{guess}; the built-ins: {', '.join(BUILT_IN)}; "
                         f"or give module:function")
    fn = spec if callable(spec) else load_attribute(spec, "--reward_fn")
    check_signature(fn, spec if isinstance(spec, str) else function_name(fn))
    return fn


def check_signature(fn: Callable, name: str) -> None:
    """A reward function is called f(prompt, completion, row), or with `batched = True` f(prompts, completions, rows):
    one that cannot be, or that names its arguments as TRL's reward functions do (completions, **columns) -> a list,
    is one line before the model loads, saying how to pass it (trl_style)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a callable whose signature Python cannot read: called as it is
        return
    batched = getattr(fn, "batched", False)
    try:
        signature.bind(None, None, None)
        fits = batched or not {"prompts", "completions"} & set(signature.parameters)
    except TypeError:
        fits = False
    if fits:
        return
    trl = "completions" in signature.parameters or any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    how = ("f(prompts, completions, rows) -> a list of floats, with `batched = True` set on it" if batched else
           "f(prompt, completion, row) -> float, or with `batched = True` set on it f(prompts, completions, rows) -> "
           "a list of floats")
    raise InputError(f"--reward_fn {name} takes {signature}" + (", as TRL's reward functions do" if trl else "") +
                     f"; a reward function here is {how}" +
                     ("; pass a TRL reward function as nanochat_ext.api.trl_reward(f)" if trl else ""))


def trl_style(fn: Callable) -> RewardFn:
    """A reward function written for TRL's GRPOTrainer, f(prompts, completions, **columns) -> a list of floats, as a
    batched reward function here, called as TRL calls it: once per step with this rank's rows, `prompts` their prompts
    as given (a text, or a conversation's messages), `completions` the replies (text, or for a conversation
    [{"role": "assistant", "content": reply}]) and each other field of the rows as a keyword list. TRL's
    completion_ids and trainer_state are not passed; a None in the answer (TRL's 'not applicable') is refused, as any
    value that is not a number is."""
    def batched(prompts: list[str], completions: list[str], rows: list[dict]) -> list:
        given = [r.get("prompt", p) for p, r in zip(prompts, rows)]
        replies = [[{"role": "assistant", "content": c}] if isinstance(g, list) else c
                   for g, c in zip(given, completions)]
        columns = {k: [r.get(k) for r in rows] for k in dict.fromkeys(k for r in rows for k in r)
                   if k not in ("prompt", "prompts", "completions")}
        return fn(prompts=given, completions=replies, **columns)
    batched.batched = True
    batched.__name__ = batched.__qualname__ = getattr(fn, "__name__", type(fn).__name__)  # its logged name
    batched.__module__ = getattr(fn, "__module__", "?")
    return batched


def function_name(fn: Callable) -> str:
    """module:qualname of a function given in Python (a callable object or a partial: its type's), as --reward_fn
    would name it: what a run records."""
    inner = getattr(fn, "func", fn)  # a partial's function
    named = inner if hasattr(inner, "__qualname__") else type(inner)
    return f"{getattr(named, '__module__', '?')}:{named.__qualname__}"


def reward_name(spec: str | RewardFn) -> str:
    """A reward's name in the logs (train/reward_<name>): the function's."""
    return function_name(spec).rsplit(".", 1)[-1].rsplit(":", 1)[-1] if callable(spec) else spec.rsplit(":", 1)[-1]


def built_in_name(spec: str | RewardFn) -> str | None:
    """The built-in reward a --reward_fn spec names (`gsm8k`, or `nanochat_ext.tasks.reward_fns:gsm8k`), else None
    (a callable included: a user's function reads what it likes)."""
    if callable(spec):
        return None
    module, _, name = spec.rpartition(":")
    return name if name in BUILT_IN and module in ("", reward_fns.__name__) else None


def check_references(specs: list[str | RewardFn], rows: list[PromptRow], path: str | None) -> None:
    """Before any rollout: every built-in reward among the --reward_fn specs finds its reference in every row it will
    score (rows: as data.load_prompts read them from path); the first row without one is one line naming the file,
    the row and the field. A user's function reads what it likes and is not checked."""
    for name in dict.fromkeys(filter(None, map(built_in_name, specs))):
        for r in rows:
            if (why := reference_problem(name, r.row)) is not None:
                raise InputError(why, path=path, line=r.line, field=REFERENCE)


def check_reward_fns(specs: list[str | RewardFn], rows: list[PromptRow], path: str | None) -> None:
    """Before any model loads: each reward function imports and can be called as a reward (load_reward_fn), and each
    built-in finds its reference in every row (check_references)."""
    for spec in specs:
        load_reward_fn(spec)
    check_references(specs, rows, path)


def checked(value, where: str, clip: float | None) -> float:
    """value as a float, or one line saying what is wrong with it: something other than a real number (a bool or
    a string included), a NaN/inf, or a value outside [-clip, clip]."""
    if isinstance(value, (bool, str, bytes)) or not hasattr(value, "__float__"):
        raise InputError(f"{where} returned {value!r} ({type(value).__name__}), not a real number")
    value = float(value)
    if not math.isfinite(value):
        raise InputError(f"{where} returned {value}")
    if clip is not None and abs(value) > clip:
        raise InputError(f"{where} returned {value}, outside --reward_clip {clip}")
    return value


def call_reward_fn(name: str, fn: RewardFn, prompt: str, completion: str, row: dict, place: str,
                   clip: float | None = None) -> float:
    """fn's value for one completion, checked; when it raises, one line naming the function and the prompt's row as
    its user numbers it (place: PromptRow.where)."""
    where = f"reward function {name} on prompt {place}"
    try:
        value = fn(prompt, completion, row)
    except Unscored:  # the machine's failure, not the answer's: left out of the loss (NaN), counted
        return math.nan
    except Exception as e:  # the user's code: any failure becomes the run's one line
        raise InputError(f"{where} raised {first_line(e)}{keep_traceback(e)}") from e  # api chains it too
    return checked(value, where, clip)


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to max_new_tokens - buffer tokens, then falling linearly to
    -penalty at max_new_tokens (a completion cut there gets the full -penalty)."""
    start = max_new_tokens - buffer
    return -penalty * ((lengths.double() - start) / buffer).clamp(min=0.0, max=1.0)


def post_rewards(url: str, prompts: list[str], completions: list[str], rows: list[dict], timeout: float) -> list:
    """One reward-service call: the completions as JSON, their rewards back (unchecked). Tries URL_RETRIES times,
    1 s then 2 s apart, on a connection failure, a timeout or a 5xx; one line naming the URL otherwise."""
    body = json.dumps({"prompts": prompts, "completions": completions, "rows": rows}, default=str).encode()  # a
    # table's row can hold dates or decimals: sent as text
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"}, method="POST")
    for attempt in range(URL_RETRIES):
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                answer = json.loads(response.read().decode())
            break
        except urllib.error.HTTPError as e:
            failure = f"HTTP {e.code} {e.reason}"
            if e.code < 500:
                raise InputError(f"--reward_url {url} answered {failure}") from None
        except urllib.error.URLError as e:  # refused, unreachable, or a timeout while connecting
            failure = str(e.reason)
        except (OSError, http.client.HTTPException) as e:  # a timeout, a dropped or garbled answer
            failure = first_line(e)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InputError(f"--reward_url {url} answered something other than JSON ({first_line(e)})") from None
        if attempt + 1 < URL_RETRIES:
            time.sleep(2 ** attempt)
    else:
        raise InputError(f"--reward_url {url} failed {URL_RETRIES} times (timeout {timeout:g} s): {failure}")
    rewards = answer.get("rewards") if isinstance(answer, dict) else None
    if not isinstance(rewards, list) or len(rewards) != len(completions):
        raise InputError(f"--reward_url {url} must answer {{\"rewards\": [...]}} with {len(completions)} values, got "
                         f"{str(answer)[:100]}")
    return rewards


def env_rewards(episodes: Episodes, places: list[str], G: int, clip: float | None) -> list[float]:
    """The environments' get_reward() values, checked as a reward function's; a failure is one line naming the
    prompt."""
    out = []
    for i, outcome in enumerate(episodes.env_rewards()):
        where = f"the environment's reward on prompt {places[i // G]} (sample {i % G})"
        if outcome.error and isinstance(outcome.value, Unscored):
            out.append(math.nan)  # the machine's failure: left out of the loss, counted
            continue
        if outcome.error:
            raise InputError(f"{where}: {outcome.text.removeprefix('Error: ')}")
        out.append(checked(outcome.value, where, clip))
    return out


class Rewards:
    """The RM score, the reward functions and the reward service, each weighted; per-reward values kept for
    logging. workers: threads for per-completion functions (1: called in turn)."""

    def __init__(self, rm: RewardScorer | None, fns: list[str], weights: list[float] | None,
                 overlong: tuple[int, int, float] | None = None, clip: float | None = None, workers: int = 1,
                 url: str | None = None, url_timeout: float = 60.0, env: bool = False, optional: bool = False):
        parts = urllib.parse.urlsplit(url or "")
        if url is not None and (parts.scheme not in ("http", "https") or not parts.netloc):
            raise InputError(f"--reward_url must be an http:// or https:// URL, got {url!r}")
        self.rm, self.clip, self.url, self.url_timeout = rm, clip, url, url_timeout
        self.fns = [(reward_name(spec), load_reward_fn(spec)) for spec in fns]
        self.env = env  # the --env environments' own rewards (get_reward), one more column
        self.names = (["rm"] if rm else []) + [name for name, _ in self.fns] + (["url"] if url else []) + \
            (["env"] if env else [])
        if len(set(self.names)) < len(self.names):  # each is a column and a logged train/reward_<name>
            twice = sorted({n for n in self.names if self.names.count(n) > 1})
            raise InputError(f"two rewards are named {', '.join(twice)} (the logs name each reward once: give the "
                             f"functions different names)")
        if not self.names and not optional:
            raise InputError("no reward: give --rm, --reward_fn, --reward_url and/or an --env with get_reward() (or "
                             "--advantage distill with a --teacher)")
        self.weights = list(weights) if weights is not None else [1.0] * len(self.names)
        if len(self.weights) != len(self.names):
            raise InputError(f"--reward_weights has {len(self.weights)} values for {len(self.names)} rewards "
                             f"({', '.join(self.names)})")
        self.overlong = overlong  # (max_new_tokens, buffer, penalty): one more reward column, weight 1
        if overlong:
            self.names.append("overlong")
            self.weights.append(1.0)
        self.pool = ThreadPoolExecutor(workers) if workers > 1 else None
        if self.pool is not None:  # its threads end with the run's rewards, not with the process
            weakref.finalize(self, self.pool.shutdown, wait=False)

    def score(self, rows: list[PromptRow], prompt_ids: list[list[int]], samples: Samples, tok: TokenizerWrapper,
              G: int) -> tuple[torch.Tensor, int]:
        """(n*G, n_rewards) raw rewards, and how many completions the RM saw cut to its max_len (it scores what it
        was trained on: prompt cut from the left, completion from the right). A reward function's or the
        service's failure or bad value, or a non-finite RM score, is raised on every rank."""
        n, places = len(samples.completions), [r.where for r in rows]
        out = torch.zeros(n, len(self.names), dtype=torch.float64)
        col, rm_cut, error, cause = 0, 0, None, None
        if self.rm is not None:
            full = [(prompt_ids[i // G], tok.reply_ids(c)) for i, c in enumerate(samples.completions)]
            rm_cut = sum(len(p) + len(c) > self.rm.max_len for p, c in full)
            seqs = [truncate(p, c, self.rm.max_len, tok.bos_id) for p, c in full]
            out[:, 0] = torch.tensor(self.rm.score_ids(seqs, group=G))  # a prompt's G samples share it
            bad = (~torch.isfinite(out[:, 0])).nonzero()
            if len(bad):
                i = int(bad[0])
                error = (f"the reward model scored {out[i, 0].item()} on prompt {places[i // G]} (completion "
                         f"{i % G}; {len(bad)} non-finite scores in this batch): the RM checkpoint is broken")
            col = 1
        texts = samples.replies(tok)
        prompts = [rows[i // G].messages[-1]["content"] for i in range(n)]
        row_dicts = [rows[i // G].row for i in range(n)]
        try:
            if error is None:
                for j, (name, fn) in enumerate(self.fns):
                    out[:, col + j] = torch.tensor(self._call(name, fn, prompts, texts, row_dicts, places, G),
                                                   dtype=torch.float64)
                if self.url:
                    values = post_rewards(self.url, prompts, texts, row_dicts, self.url_timeout)
                    out[:, col + len(self.fns)] = torch.tensor(
                        [checked(v, f"--reward_url {self.url} on prompt {places[i // G]}", self.clip)
                         for i, v in enumerate(values)], dtype=torch.float64)
                if self.env:
                    out[:, self.names.index("env")] = torch.tensor(env_rewards(samples.episodes, places, G, self.clip),
                                                                   dtype=torch.float64)
        except InputError as e:
            error, cause = str(e), e.__cause__
        raise_if_any(error, cause)
        if self.overlong:
            out[:, -1] = overlong_penalty(torch.tensor([len(c) for c in samples.completions]), *self.overlong)
        return out, rm_cut

    def _call(self, name: str, fn: RewardFn, prompts: list[str], texts: list[str], rows: list[dict], places: list[str],
              G: int) -> list[float]:
        """One function's values for every completion: once with the lists (batched), else per completion, in the
        pool where there is one (the same values in the same order). places: each prompt's row as its user numbers
        it (PromptRow.where)."""
        if getattr(fn, "batched", False):
            prompts_named = list(dict.fromkeys(places))  # a prompt once, whatever its replies
            shown = prompts_named[0] + (f" and {len(prompts_named) - 1} more" if len(prompts_named) > 1 else "")
            where = f"reward function {name} (batched) on the prompts {shown}"
            try:
                values = fn(prompts, texts, rows)
            except Unscored:  # the machine's failure for the whole batch: every completion left out, counted
                return [math.nan] * len(texts)
            except Exception as e:  # the user's code
                raise InputError(f"{where} raised {first_line(e)}{keep_traceback(e)}") from e  # api chains it too
            if not hasattr(values, "__len__") or isinstance(values, (str, bytes)) or len(values) != len(texts):
                raise InputError(f"{where} returned {type(values).__name__} of "
                                 f"{len(values) if hasattr(values, '__len__') else '?'} values for "
                                 f"{len(texts)} completions")
            return [checked(v, f"reward function {name} on prompt {places[i // G]}", self.clip)
                    for i, v in enumerate(values)]
        one = lambda i: call_reward_fn(name, fn, prompts[i], texts[i], rows[i], places[i // G], self.clip)  # noqa: E731
        return list(self.pool.map(one, range(len(texts))) if self.pool else map(one, range(len(texts))))

    def task_column(self) -> int:
        """The column of the task reward pass@k reads (the first reward function); one line where there is none."""
        if not self.fns:
            raise InputError("pass@k needs a task reward that scores a completion 1 when it is correct: give "
                             "--reward_fn (e.g. gsm8k)")
        return self.names.index(self.fns[0][0])

    def task_scores(self, rows: list[PromptRow], indices: list[int], texts: list[str], which: int = 0) -> list[float]:
        """The task reward (the first reward function; which: another) of each text, a completion of
        rows[indices[k]]."""
        self.task_column()  # one line where there is no reward function
        name, fn = self.fns[which]
        return self._call(name, fn, [rows[i].messages[-1]["content"] for i in indices], texts,
                          [rows[i].row for i in indices], [rows[i].where for i in indices], 1)

    def total(self, per_reward: torch.Tensor) -> torch.Tensor:
        return per_reward @ torch.tensor(self.weights, dtype=torch.float64)


def check_rm_tokenizer(rm: RewardScorer, tok: TokenizerWrapper, rm_path: str) -> None:
    """The RM scores the policy's token ids directly, so both must speak the same tokenizer."""
    if not same_ids(rm.tokenizer, tok):
        raise InputError(f"reward model was trained with another tokenizer ({rm.tokenizer.source}, "
                         f"{rm.tokenizer.vocab_size} ids) than the policy's ({tok.source}, {tok.vocab_size} ids)",
                         path=rm_path)


def make_rewards(cfg: RewardConfig, tok: TokenizerWrapper, device, overlong: tuple[int, int, float] | None,
                 pass_k: bool, env: bool = False, optional: bool = False) -> Rewards:
    """The run's rewards: --rm loaded (one line where it does not speak the policy's tokenizer), the reward functions,
    the service, the environments' own (env); pass_k: checked to have the task reward pass@k reads. optional: none
    at all is fine (distillation, whose teacher is its signal)."""
    rm = None
    if cfg.rm:
        rm = load_reward_model(cfg.rm, device, backbone=cfg.rm_backbone)
        check_rm_tokenizer(rm, tok, cfg.rm)
    rewards = Rewards(rm, cfg.reward_fn or [], cfg.reward_weights, overlong, cfg.reward_clip, cfg.reward_workers,
                      cfg.reward_url, cfg.reward_timeout, env, optional)
    if pass_k:
        rewards.task_column()
    return rewards
