"""The rollout engine: batched sampling for the policy (nanochat keeps its Engine apart from its GPT, and so do
we). Prompts are left-padded and prefilled once, each prompt's cache serves its group of samples, and all rows
decode in lockstep until every row has stopped. Which token a row takes is sampling.py's rule, so a prompt's
samples are the same whichever way the engine runs (up to float ties between computation orders).

One decode loop (`Engine._decode`) drives a runner (runner.py): eager (every model) or compiled (our models,
`--compile`: a compiled step over kept static state, a CUDA graph on a GPU). After each step it reads whether every
row has stopped (every END_CHECK_EVERY steps), hands the step to the rollouts' agent where there is one (a hook: the
tool calls a step closed answered, the turns it ended followed by the next; agent/agent.py), and shrinks the batch
as rows stop (scheduler.py).

On a CPU, a step that streams its weights from memory decodes from a copy of them packed for oneDNN's GEMM, packed
again at every call (packed.py): up to 2.5x the GB/s of F.linear at a few rows.

Under a lower-precision autocast (bf16 on CUDA) the engine decodes from its own copy of the policy's matmul
weights in that dtype, refreshed from the fp32 masters at every call (a rollout, an evaluation). Autocast would
cast the masters to the same values at every matmul, so the tokens are bitwise those of the masters under
autocast, but a step reads half the weight bytes and casts nothing (but an LM head tied to the embedding,
which stays the policy's own tensor).

A policy about to be sharded (--parallel fsdp) gives the engine `whole_in`: it keeps a whole copy of the policy, every
floating tensor in that dtype (the dtype FSDP gathers the weights in), and refreshes it at every call by gathering
each weight from its shards once: one all-gather per weight per rollout, not per block per token, and decoding
reads plain tensors that stay where they are.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn as nn

from nanochat_ext.ddp_common import is_sharded, whole
from nanochat_ext.engine.cost import DecodeStats, kv_bytes, weight_bytes
from nanochat_ext.engine.forcing import ToolState
from nanochat_ext.engine.packed import PackedCopy, packs
from nanochat_ext.engine.runner import Call, CompiledRunner, EagerRunner, KeptStates
from nanochat_ext.engine.sampling import SamplingConfig
from nanochat_ext.engine.scheduler import LiveRows, shrunk_rows
from nanochat_ext.models.backbone import Backbone, matmul_params, shared_copy
from nanochat_ext.models.compiled import compile_stats
from nanochat_ext.tokenizer import TokenizerWrapper

# Decode steps between reads of whether every row has stopped. A read waits for the device (on CUDA the host cannot
# queue the next step's launch meanwhile) and costs the host time; rows that stopped take pads, so a late read adds up
# to 7 steps of pads to a call. Compiled decoding on CPU ran 5% and 16% faster reading every 8 steps (no early stops,
# bench/RESULTS.md); eager decoding on CPU gained nothing (+0.1%, -1.0%): it reads every step.
END_CHECK_EVERY = 8


class StepHook(Protocol):
    """One generate call's episodes (agent/agent.py's Episodes), which the loop hands every step: `after_step` answers
    the tool calls token t closed and follows the turns it ended (forcing the next turn's tokens into a row, reviving
    it), reading the device once, and says (whether every row has stopped, how many have). `of` maps rows of the
    current batch to the call's rows. Their counts go into the Samples."""
    tool_calls: int
    tool_errors: int
    tool_timeouts: int
    env_errors: int
    env_timeouts: int
    turns: list[int]
    turn_start: list[int]

    def after_step(self, t: int, out: torch.Tensor, lengths: torch.Tensor, done: torch.Tensor, tools: ToolState,
                   of: Callable[[list[int]], list[int]]) -> tuple[bool, int]: ...


class RolloutAgent(Protocol):
    """What rollouts run with besides the model (agent/agent.py's Agent): `python`, nanochat's (python_start,
    python_end) ids where the step tracks python blocks on the device; `episodes`, a call's StepHook."""
    active: bool
    python: tuple[int, int] | None

    def episodes(self, rows: list[dict], group: int) -> StepHook: ...


@dataclass
class Samples:
    completions: list[list[int]]  # one per sample (prompt-major: prompt i's samples are i*G .. i*G+G-1)
    truncated: list[bool]  # stopped by max_new_tokens, not by a stop token
    sampled: list[list[int]] | None = None  # with an agent, per completion token: 1 sampled, 0 forced
    tool_calls: int = 0  # tool calls made (python blocks closed, tool calls in turns)
    tool_errors: int = 0  # of them, the ones refused or failed
    tool_timeouts: int = 0  # of them, the ones that ran past --tool_timeout
    env_errors: int = 0  # environment calls that failed (an ended environment's too)
    env_timeouts: int = 0  # of them, the ones that ran past --tool_timeout
    turns: list[int] | None = None  # with an agent, each completion's assistant turns
    turn_starts: list[int] | None = None  # with an agent, where each completion's last assistant turn begins
    episodes: StepHook | None = field(default=None, compare=False, repr=False)  # their environments, for rewards
    logprobs: list[list[float]] | None = None  # Engine(logprobs=True): each token's sampling.token_logprob

    @classmethod
    def of(cls, completions: list[list[int]], truncated: list[bool], sampled: list[list[int]] | None,
           episodes: StepHook | None, logprobs: list[list[float]] | None = None) -> Samples:
        if episodes is None:
            return cls(completions, truncated, sampled, logprobs=logprobs)
        return cls(completions, truncated, sampled, episodes.tool_calls, episodes.tool_errors, episodes.tool_timeouts,
                   episodes.env_errors, episodes.env_timeouts, list(episodes.turns), list(episodes.turn_start),
                   episodes, logprobs)

    def replies(self, tok: TokenizerWrapper) -> list[str]:
        """What reward functions read of each completion: its last assistant turn, without the stop it ended
        with. A tool's or an environment's turn is not the policy's answer (a product a tool turn states is not
        the model's); a python block's output is inside the turn, as nanochat's own reward reads it."""
        starts = self.turn_starts or [0] * len(self.completions)
        return [tok.reply_text(c[start:]) for c, start in zip(self.completions, starts)]


class Engine:
    """Samples completions from `model` (a Backbone: nanochat GPT, native Llama or a transformers module).
    compile: decode with a compiled step over kept static state (our models; transformers ones decode eagerly).
    agent: the tools and environment the rollouts run with (agent/agent.py). reserve: the longest prompt + new tokens
    any call of the run will need (runner.KeptStates). end_check_every: decode steps between reads of whether every
    row has stopped (default END_CHECK_EVERY, but 1 for eager decoding on CPU); with an agent the host reads every
    step, to answer a block the step closed or a turn it ended. drop_finished: the batch shrinks as rows stop
    (scheduler.shrunk_rows; the same tokens: each row's logits are its own, up to a batch size's rounding). logprobs:
    the samples carry each token's log-prob as the engine computed it (sampling.token_logprob), for comparing with
    the trainer's. held: the whole copy (whole_in) is refreshed only when the caller says so (refresh()), never by a
    call: a rollout decoding in another thread while the policy trains reads the weights it was given, whole.
    pack: decode from the weights packed for the CPU's GEMM (packed.py), repacked at every call; None: where
    packed.packs measures it faster."""

    def __init__(self, model: Backbone, compile: bool = False, whole_in: torch.dtype | None = None,
                 agent: RolloutAgent | None = None, reserve: int = 0, end_check_every: int | None = None,
                 drop_finished: bool = True, logprobs: bool = False, held: bool = False, pack: bool | None = None):
        self.model, self.held, self.pack = model, held, pack
        self.drop_finished, self.logprobs = drop_finished, logprobs
        self.agent = agent if agent is not None and agent.active else None
        self.compiled = compile and model.native
        self.kept = KeptStates(reserve, tools=self.agent is not None) if self.compiled else None
        eager_on_cpu = next(model.parameters()).device.type == "cpu" and not self.compiled
        self.end_check_every = 1 if self.agent else end_check_every or (1 if eager_on_cpu else END_CHECK_EVERY)
        self._lowered: tuple[Backbone, list[tuple[str, torch.Tensor]]] | None = None  # (copy, (name, its tensor))
        self._packed: PackedCopy | None = None  # the decoder's copy over packed weights (CPU: packed.py)
        self._whole = whole_in is not None
        if self._whole:  # made now, before the policy is sharded: a copy of a sharded module would hold shards
            self._lowered = lowered_copy(model, [p for p in model.parameters() if p.is_floating_point()], whole_in)
        self.last: DecodeStats | None = None

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], group_size: int, cfg: SamplingConfig,
                 stop_ids: int | Sequence[int], pad_id: int, generators: list[torch.Generator],
                 rows: list[dict] | None = None) -> Samples:
        """group_size samples of each prompt, prompt-major; prompt i draws its uniforms from generators[i] (and its
        environments, with an agent, are made from rows[i]). A row ends at the first of stop_ids it takes (the
        tokenizer's stop_ids: every token that ends a turn), kept as its last token, unless the agent forces another
        turn after it; or after max_new_tokens."""
        device = next(self.model.parameters()).device
        n, G, P = len(prompts), group_size, max(len(p) for p in prompts)
        if P + cfg.max_new_tokens > self.model.max_seq_len:  # a compiled step would index past the rotary table
            raise ValueError(f"a prompt of {P} tokens + {cfg.max_new_tokens} new ones exceeds the model's "
                             f"{self.model.max_seq_len} positions")
        stops = [stop_ids] if isinstance(stop_ids, int) else list(dict.fromkeys(stop_ids))
        ids = torch.full((n, P), pad_id, dtype=torch.long)
        key_mask = torch.zeros((n, P), dtype=torch.bool)
        for i, p in enumerate(prompts):  # left padding: every prompt ends at position P-1
            ids[i, P - len(p):] = torch.tensor(p)
            key_mask[i, P - len(p):] = True
        uniforms = torch.cat([torch.rand(G, cfg.max_new_tokens, generator=g) for g in generators]).to(device)
        decoder = self._packed_over(self._decoder(device), n * G, device)
        call = Call(decoder, ids.to(device), key_mask.to(device), G, uniforms, cfg,
                    torch.tensor(stops, dtype=torch.long, device=device), pad_id,
                    self.agent.python if self.agent else None, self.logprobs, self.agent is not None)
        episodes = self.agent.episodes(rows if rows is not None else [{}] * n, G) if self.agent else None
        sync(device)
        t0, compiling = time.perf_counter(), compile_stats()[1]
        try:
            run = CompiledRunner(self.kept, call) if self.compiled else EagerRunner(call)
            sync(device)
            t1 = time.perf_counter()
            out, lengths, done, logps, tools = self._decode(run, cfg.max_new_tokens, episodes)
            sync(device)
        finally:
            if self._packed is not None:  # a call's own: training never holds them
                self._packed.release()
        t2 = time.perf_counter()
        compiled_s = compile_stats()[1] - compiling  # a new shape's compile, in the first step: not decoding
        context = P + run.decodes / 2  # a step's average context, as nanochat's infer_bench takes the middle one
        self.last = DecodeStats(n * G, run.decodes, t1 - t0, max(t2 - t1 - compiled_s, 0.0), weight_bytes(decoder),
                                kv_bytes(decoder, context), run.row_steps)
        lengths, done, out = lengths.tolist(), done.tolist(), out.tolist()
        sampled = [row[:k] for row, k in zip(tools.sampled.int().tolist(), lengths)] if tools is not None else None
        logprobs = [row[:k] for row, k in zip(logps.tolist(), lengths)] if logps is not None else None
        return Samples.of([row[:k] for row, k in zip(out, lengths)], [not d for d in done], sampled, episodes, logprobs)

    def _decode(self, run: EagerRunner | CompiledRunner, max_new: int, episodes: StepHook | None) -> tuple:
        """The decode loop: token t of every row taken (and fed back, but the last), then the end check and the
        agent's hook, then the batch shrunk where rows stopped; until every row has stopped or max_new tokens are
        taken. Returns the call's (out, lengths, done, log-probs, tool state)."""
        batch = LiveRows(*run.head())  # which of the call's rows the runner holds
        last = max_new - 1
        for t in range(max_new):
            run.take(t, feed=t < last)
            finished, stopped = self._check(run, t, episodes, batch)
            if finished or t == last:
                break
            if self.drop_finished and stopped is not None and \
                    (rows := shrunk_rows(run.rows, run.rows - stopped, run.static)) < run.rows:
                run.shrink(batch.shrink(*run.head()), rows)
            run.feed(t)
        return batch.whole(*run.head())

    def _check(self, run: EagerRunner | CompiledRunner, t: int, episodes: StepHook | None,
               batch: LiveRows) -> tuple[bool, int | None]:
        """After token t: (whether every row has stopped, how many have), read every end_check_every steps, else
        (False, None); with an agent, its hook's answer, every step."""
        out, lengths, done, tools = run.stepped()
        if episodes is not None:
            return episodes.after_step(t, out, lengths, done, tools, batch.of)
        if (t + 1) % self.end_check_every:
            return False, None
        stopped = int(done.sum())
        return stopped == done.numel(), stopped

    def _decoder(self, device: torch.device) -> Backbone:
        """The model to decode with: the whole copy of a sharded policy; under an autocast to a lower precision
        than the masters, a copy whose matmul weights are held in that dtype (embeddings, norms and scalars are
        the policy's own tensors, shared); either refreshed from the masters now. Else the model itself."""
        if not self._whole:
            if not torch.is_autocast_enabled(device.type):
                return self.model
            dtype = torch.get_autocast_dtype(device.type)
            if self._lowered is None or self._lowered[1][0][1].dtype != dtype:
                masters = [p for p in matmul_params(self.model) if p.is_floating_point() and p.dtype != dtype]
                if not masters:
                    return self.model
                self._lowered = lowered_copy(self.model, masters, dtype)
        return self._lowered[0] if self.held else self.refresh()

    def _packed_over(self, decoder: Backbone, rows: int, device: torch.device) -> Backbone:
        """The decoder, or where its matmuls run faster from packed weights (pack; None: packed.packs decides) its
        packed copy, repacked from its weights now."""
        if not (packs(decoder, device) if self.pack is None else self.pack):
            self._packed = None
            return decoder
        if self._packed is None or self._packed.source is not decoder:
            self._packed = PackedCopy(decoder)
        return self._packed.packed(rows)

    def refresh(self) -> Backbone | None:
        """Copy the policy's current weights into the engine's copy (if it keeps one) and return the copy.
        Collective for a sharded policy's whole copy: every rank calls it (generate does), also a rank that has
        nothing to decode."""
        if self._lowered is None:
            return None
        lowered, pairs = self._lowered
        masters = dict(self.model.named_parameters())  # by name: sharding replaces the parameter objects
        for name, low in pairs:
            master = masters[name]
            # A shard is cast before it is gathered: bf16 over the wire, half the bytes of fp32, the same values.
            low.copy_(whole(master.to(low.dtype) if is_sharded(master) else master))
        return lowered

    @property
    def states(self) -> dict:
        """The compiled decode states kept between calls, by row count (none: eager)."""
        return self.kept.states if self.kept is not None else {}

    @property
    def reserved_slots(self) -> int:
        """The cache positions of a compiled state made for the reserve (and any call that fits it)."""
        return self.kept.reserved_slots if self.kept is not None else 0

    def kept_rows(self, calls: Iterable[int]) -> tuple[int, ...]:
        """The row counts a compiled engine keeps a decode state for, given its calls' row counts: each, and with
        drop_finished each count a call's live rows may move into (none: eager)."""
        return self.kept.kept_rows(calls, self.drop_finished) if self.kept is not None else ()

    def kept_bytes(self) -> int:
        """Bytes the engine holds between calls: the compiled decode states and the lower-precision weights (packed
        weights live through a call only)."""
        held = self.kept.tensors() if self.kept is not None else []
        if self._lowered is not None:
            held += [low for _, low in self._lowered[1]]
        return sum(t.numel() * t.element_size() for t in held)


def lowered_copy(model: Backbone, masters: list[nn.Parameter], dtype: torch.dtype
                 ) -> tuple[Backbone, list[tuple[str, torch.Tensor]]]:
    """A copy of model sharing every tensor but `masters`, which it holds in dtype; with (master's name, copy)
    pairs."""
    # a copy of its own also in the masters' dtype (a held engine decodes while the masters train)
    own = {id(p): nn.Parameter(p.detach().to(dtype, copy=True), requires_grad=False) for p in masters}
    return shared_copy(model, own), [(name, own[id(p)]) for name, p in model.named_parameters() if id(p) in own]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
