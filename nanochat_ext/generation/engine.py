"""The rollout engine: batched sampling for the policy (nanochat keeps its Engine apart from its GPT, and so do
we). Prompts are left-padded and prefilled once, each prompt's cache serves its group of samples, and all rows
decode in lockstep until every row has stopped. Which token a row takes is sampling.py's rule, so a prompt's
samples are the same whichever way the engine runs (up to float ties between computation orders).

Two ways to decode:
- eager: a cache allocated per call (prompt + new tokens; transformers' own modules grow their DynamicCache),
  every model; once a quarter of the rows have stopped, decoding goes on with the live rows alone.
- compiled (our models, `--compile`): the decode state of one batch shape (the KV cache, the step's buffers and
  counters) is allocated once, kept at fixed addresses (`mark_static_address`) and reused by later calls, and one
  decode step (take token t, feed it back) is a torch.compile'd function that reads and writes only that state,
  in place. A second call of the same shape then adds no graph, and on CUDA (mode reduce-overhead) the step is
  captured once as a CUDA graph and replayed: nothing it touches moves or is allocated between steps.

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

import copy
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
import torch.nn as nn

from nanochat_ext.ddp_common import is_sharded, whole
from nanochat_ext.generation.agent import Agent, Episodes
from nanochat_ext.generation.decode_cost import DecodeStats, kv_bytes, weight_bytes
from nanochat_ext.generation.sampling import SamplingConfig, take_tokens
from nanochat_ext.generation.static_decode import (DecodeState, LiveRows, compact_into, compacted_rows,
                                                    compaction_sizes, compile_for, decode_step,
                                                    read_length)
from nanochat_ext.generation.tools import ToolState
from nanochat_ext.models.attention import KVCache
from nanochat_ext.models.backbone import Backbone, matmul_params
from nanochat_ext.models.compiled import compile_stats
from nanochat_ext.tokenizer import TokenizerWrapper

SLOT_BUCKET = 64  # a compiled decode state's cache length is rounded up to this, so most calls reuse one

# Eager decoding drops the rows that have stopped once they are this share of the batch: the step's work that grows
# with its rows (attention over each row's cache, the LM head, sampling over the vocabulary) is then the live rows'
# alone, and a long tail of a few rows costs what those rows cost. A drop copies the live rows' cache once.
DROP_FINISHED_AT = 0.25
# Decode steps between reads of whether every row has stopped. A read waits for the device (on CUDA the host cannot
# queue the next step's launch meanwhile) and costs the host time; rows that stopped take pads, so a late read adds up
# to 7 steps of pads to a call. Compiled decoding on CPU ran 5% and 16% faster reading every 8 steps (no early stops,
# bench/RESULTS.md); eager decoding on CPU gained nothing (+0.1%, -1.0%): it reads every step.
END_CHECK_EVERY = 8


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
    episodes: Episodes | None = field(default=None, compare=False, repr=False)  # their environments, for rewards
    logprobs: list[list[float]] | None = None  # Engine(logprobs=True): each token's sampling.token_logprob

    @classmethod
    def of(cls, completions: list[list[int]], truncated: list[bool], sampled: list[list[int]] | None,
           episodes: Episodes | None, logprobs: list[list[float]] | None = None) -> "Samples":
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
    agent: the tools and environment the rollouts run with (agent.py). reserve: the longest prompt + new tokens any
    call of the run will need; a compiled state is made that long at once, so a longer batch later does not
    rebuild it (new static addresses: a recompile and, on CUDA, a new graph recording). end_check_every: decode
    steps between reads of whether every row has stopped (default END_CHECK_EVERY, but 1 for eager decoding on CPU);
    with an agent the host reads every step, to answer a block the step closed or a turn it ended. drop_finished:
    eager decoding goes on with the live rows alone once DROP_FINISHED_AT of them have stopped for good (the same
    tokens: each row's logits are its own, up to a batch size's rounding). logprobs: the samples carry each token's
    log-prob as the engine computed it (sampling.token_logprob), for comparing with the trainer's."""

    def __init__(self, model: Backbone, compile: bool = False, whole_in: torch.dtype | None = None,
                 agent: Agent | None = None, reserve: int = 0, end_check_every: int | None = None,
                 drop_finished: bool = True, logprobs: bool = False):
        self.model = model
        self.drop_finished, self.logprobs = drop_finished, logprobs
        self.reserve = reserve
        self.agent = agent if agent is not None and agent.active else None
        self._python = self.agent.python if self.agent else None
        self.compiled = compile and model.native
        eager_on_cpu = next(model.parameters()).device.type == "cpu" and not self.compiled
        self.end_check_every = 1 if self.agent else end_check_every or (1 if eager_on_cpu else END_CHECK_EVERY)
        self._states: dict[int, DecodeState] = {}  # rows -> the kept decode state (compiled only)
        self._step = None
        self._lowered: tuple[Backbone, list[tuple[str, torch.Tensor]]] | None = None  # (copy, (name, its tensor))
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
        stops = torch.tensor(stops, dtype=torch.long, device=device)
        ids = torch.full((n, P), pad_id, dtype=torch.long)
        key_mask = torch.zeros((n, P), dtype=torch.bool)
        for i, p in enumerate(prompts):  # left padding: every prompt ends at position P-1
            ids[i, P - len(p):] = torch.tensor(p)
            key_mask[i, P - len(p):] = True
        ids, key_mask = ids.to(device), key_mask.to(device)
        uniforms = torch.cat([torch.rand(G, cfg.max_new_tokens, generator=g) for g in generators]).to(device)
        decoder = self._decoder(device)
        episodes = self.agent.episodes(rows if rows is not None else [{}] * n, G) if self.agent else None
        sync(device)
        t0, compiling = time.perf_counter(), compile_stats()[1]
        if self.compiled:
            state = self._prefill_state(decoder, ids, key_mask, G, uniforms, cfg, stops, pad_id)
            sync(device)
            t1 = time.perf_counter()
            steps, row_steps = self._decode_compiled(decoder, state, cfg, pad_id, episodes, P)
            out, lengths, done, tools = state.out, state.lengths, state.done, state.tools
            logps = state.logps if self.logprobs else None
        else:
            logits, cache, key_mask = self._prefill_eager(decoder, ids, key_mask, G, cfg.max_new_tokens)
            sync(device)
            t1 = time.perf_counter()
            out, lengths, done, logps, tools, steps, row_steps = self._decode_eager(decoder, logits, cache, key_mask,
                                                                                    uniforms, cfg, stops, pad_id,
                                                                                    episodes)
        sync(device)
        t2 = time.perf_counter()
        compiled_s = compile_stats()[1] - compiling  # a new shape's compile, in the first step: not decoding
        context = P + steps / 2  # a step's average context, as nanochat's infer_bench takes the middle one
        self.last = DecodeStats(n * G, steps, t1 - t0, max(t2 - t1 - compiled_s, 0.0), weight_bytes(decoder),
                                kv_bytes(decoder, context), row_steps)
        lengths, done, out = lengths.tolist(), done.tolist(), out.tolist()
        sampled = [row[:k] for row, k in zip(tools.sampled.int().tolist(), lengths)] if tools is not None else None
        logprobs = [row[:k] for row, k in zip(logps.tolist(), lengths)] if logps is not None else None
        return Samples.of([row[:k] for row, k in zip(out, lengths)], [not d for d in done], sampled, episodes, logprobs)

    # ---- eager ------------------------------------------------------------------------------------
    def _prefill_eager(self, decoder: Backbone, ids: torch.Tensor, key_mask: torch.Tensor, G: int, max_new: int):
        # Prompts of one length need no mask at all (our models); transformers' always takes one.
        use_mask = not bool(key_mask.all()) or not decoder.native
        logits, cache = decoder.prefill(ids, key_mask if use_mask else None, ids.size(1) + max_new)
        decoder.repeat_cache(cache, G)
        return logits.repeat_interleave(G, dim=0), cache, key_mask.repeat_interleave(G, dim=0) if use_mask else None

    def _decode_eager(self, decoder: Backbone, logits: torch.Tensor, cache, key_mask: torch.Tensor | None,
                      uniforms: torch.Tensor, cfg: SamplingConfig, stop_ids: torch.Tensor, pad_id: int,
                      episodes: Episodes | None):
        rows, device = logits.size(0), logits.device
        out = torch.full((rows, cfg.max_new_tokens), pad_id, dtype=torch.long, device=device)
        done = torch.zeros(rows, dtype=torch.bool, device=device)
        lengths = torch.full((rows,), cfg.max_new_tokens, dtype=torch.long, device=device)
        tools = ToolState.empty(rows, cfg.max_new_tokens, device) if self.agent else None
        logps = torch.zeros(rows, cfg.max_new_tokens, device=device) if self.logprobs else None
        steps = torch.arange(cfg.max_new_tokens, device=device)  # token t is steps[t]
        batch = LiveRows(out, lengths, done, logps, tools)  # the rows decoding now, after any drop of those that stopped
        for t in range(cfg.max_new_tokens):
            live = ~done
            token = take_tokens(logits, uniforms[:, t], steps[t], out, lengths, done, cfg, stop_ids, pad_id,
                                tools.force if tools is not None else None, logps)
            if self._python is not None:
                tools.track(token, steps[t], live, *self._python)
            finished, stopped = self._finished(done, lengths, tools, out, t, episodes, batch)
            if t == cfg.max_new_tokens - 1 or finished:
                return (*batch.whole(out, lengths, done, logps, tools), t, batch.row_steps)
            if self.drop_finished and stopped is not None and stopped >= DROP_FINISHED_AT * done.numel():
                keep = batch.drop(out, lengths, done, logps, tools)  # go on with the live rows alone
                decoder.select_cache(cache, keep)
                logits, uniforms, token = logits[keep], uniforms[keep], token[keep]
                out, lengths, done = out[keep], lengths[keep], done[keep]
                logps = logps[keep] if logps is not None else None
                key_mask = key_mask[keep] if key_mask is not None else None
                tools = tools.select(keep) if tools is not None else None
            if key_mask is not None:
                key_mask = torch.cat([key_mask, torch.ones_like(key_mask[:, :1])], dim=1)
            logits = decoder.decode(cache, token, key_mask)
            batch.row_steps += token.size(0)
        return out, lengths, done, logps, tools, 0, 0  # max_new_tokens 0

    def _finished(self, done: torch.Tensor, lengths: torch.Tensor, tools: ToolState | None, out: torch.Tensor, t: int,
                  episodes: Episodes | None, batch: LiveRows | None = None) -> tuple[bool, int | None]:
        """After token t: (whether every row has stopped, how many have), read every end_check_every steps, else
        (False, None). With an agent, in the same read from the device: the blocks token t closed are answered, and
        the rows whose token t ended a turn are asked for their next one (batch: which of the call's rows the
        tensors hold, after eager decoding dropped some)."""
        if tools is None:
            if (t + 1) % self.end_check_every:
                return False, None
            stopped = int(done.sum())
            return stopped == done.numel(), stopped
        ended = done & (lengths == t + 1)
        stopped, closed, any_ended = torch.stack([done.sum(), tools.closed.any(), ended.any()]).tolist()
        finished, room = stopped == done.numel(), out.size(1) - t - 1  # room: tokens left after token t
        of = batch.of if batch is not None else (lambda rows: rows)
        if closed and not finished and room:
            rows, blocks = tools.closed_blocks(out, t)
            for row, ids in zip(rows, episodes.answer_blocks([self.agent.tok.decode(b) for b in blocks], of(rows))):
                tools.queue(row, ids)
        if any_ended and self.agent.turns:
            rows = ended.nonzero().squeeze(1).tolist()
            calls = of(rows)  # the episodes' rows
            texts = [self.agent.tok.turn_text(out[row, episodes.turn_start[call]:t].tolist())
                     for row, call in zip(rows, calls)]
            for row, call, ids in zip(rows, calls, episodes.after_turns(calls, texts, room)):
                if ids:
                    tools.queue(row, ids[:room])
                    done[row], lengths[row] = False, out.size(1)
                    episodes.turn_start[call] = min(t + 1 + len(ids), out.size(1))
                    tools.in_block[row] = False  # a block the ended turn left open is not the next turn's
                    finished, stopped = False, stopped - 1
        return finished, stopped

    # ---- compiled ---------------------------------------------------------------------------------
    def _prefill_state(self, decoder: Backbone, ids: torch.Tensor, key_mask: torch.Tensor, G: int,
                       uniforms: torch.Tensor, cfg: SamplingConfig, stop_ids: torch.Tensor,
                       pad_id: int) -> DecodeState:
        """Prefill the prompts once (eagerly, into a cache of their own length), then fill the kept state of
        this many rows with each prompt's cache, logits and mask repeated for its G samples."""
        n, P = ids.shape
        logits, prompt_cache = decoder.prefill(ids, key_mask, P)
        s = self._state(decoder, n * G, P + cfg.max_new_tokens, cfg.max_new_tokens, len(stop_ids), prompt_cache,
                        logits)

        def fill(dst: torch.Tensor, src: torch.Tensor) -> None:  # dst's n*G rows <- src's n rows, G times each
            dst.unflatten(0, (n, G)).copy_(src.unsqueeze(1))

        for dst, src in zip(s.cache.k + s.cache.v, prompt_cache.k + prompt_cache.v):
            fill(dst[:, :, :P], src)
        if prompt_cache.prev_embedding is not None:
            fill(s.cache.prev_embedding, prompt_cache.prev_embedding)
        fill(s.logits, logits)
        s.key_valid.zero_()
        fill(s.key_valid[:, :P], key_mask)
        fill(s.positions, key_mask.sum(-1))
        s.uniforms.copy_(uniforms)
        s.out.fill_(pad_id)
        s.logps.zero_()
        s.stop_ids.copy_(stop_ids)
        s.lengths.fill_(cfg.max_new_tokens)
        s.done.zero_()
        s.t.zero_()
        s.slot.fill_(P)
        if s.tools is not None:
            s.tools.reset()
        return s

    def _state(self, decoder: Backbone, rows: int, needed: int, max_new: int, stops: int, like: KVCache,
               logits: torch.Tensor, exact: bool = False) -> DecodeState:
        """The kept state for `rows` rows, made (again) when there is none or it is too short for `needed` slots
        (exact: has other than `needed` slots); one per row count, so a run holds one for its rollouts, one for its
        evaluation, and one for each row count they are compacted into."""
        s = self._states.get(rows)
        if s is not None and (s.slots == needed if exact else s.slots >= needed) and s.uniforms.size(1) == max_new and s.logits.shape == (
                rows, logits.size(1)) and s.cache.k[0].dtype == like.k[0].dtype and len(s.stop_ids) == stops:
            return s
        self._states.pop(rows, None)  # freed before the larger one is made
        slots = max(-(-needed // SLOT_BUCKET) * SLOT_BUCKET, self.reserved_slots)
        k = like.k[0]
        cache = KVCache(len(like.k), rows, k.size(1), k.size(3), slots, k.device, k.dtype)
        if like.prev_embedding is not None:
            cache.prev_embedding = like.prev_embedding.new_zeros(rows, *like.prev_embedding.shape[1:])
        device = k.device
        s = DecodeState(cache, logits.new_zeros(rows, logits.size(1)),
                        torch.zeros(rows, max_new, device=device),
                        torch.zeros(rows, max_new, dtype=torch.long, device=device),
                        torch.zeros(rows, max_new, device=device),
                        torch.zeros(stops, dtype=torch.long, device=device),
                        torch.zeros(rows, dtype=torch.long, device=device),
                        torch.zeros(rows, dtype=torch.bool, device=device),
                        torch.zeros(rows, dtype=torch.long, device=device),
                        torch.zeros(rows, slots, dtype=torch.bool, device=device),
                        torch.zeros((), dtype=torch.long, device=device),
                        torch.zeros(1, dtype=torch.long, device=device),
                        ToolState.empty(rows, max_new, device) if self.agent else None)
        cache.slot = s.slot
        for t in s.tensors():
            torch._dynamo.mark_static_address(t)
        self._states[rows] = s
        return s

    def _decode_compiled(self, decoder: Backbone, s: DecodeState, cfg: SamplingConfig, pad_id: int,
                         episodes: Episodes | None, start: int) -> tuple[int, int]:
        """The compiled step until every row has stopped (token t at cache slot start + t), each step reading the
        cache's slots in use rounded up to a length bucket (static_decode.read_length); with drop_finished, the live
        rows move into a kept state of half the rows while they fit in it (compacted_rows). Every row's outputs end
        in s, the call's state. Returns (steps, rows decoded summed over them)."""
        if self._step is None:
            self._step = compile_for(decode_step, s.t.device)
        last, row_steps = cfg.max_new_tokens - 1, 0
        batch = LiveRows(*s.head(s.rows)[:3], s.logps if self.logprobs else None, s.tools)  # which rows `now` holds
        now = s
        for t in range(last):
            now.cache.limit = read_length(start + t + 1, now.slots)
            self._step(decoder.model, now, cfg, pad_id, self._python, self.logprobs)
            row_steps += now.rows
            finished, stopped = self._finished(now.done, now.lengths, now.tools, now.out, t, episodes, batch)
            if finished:
                break
            if self.drop_finished and stopped is not None and \
                    (rows := compacted_rows(now.rows, now.rows - stopped)) < now.rows:
                now = self._compacted(decoder, now, batch, rows)
        else:
            if last >= 0:  # the last token needs no decoding after it; a turn it ends is still the environment's
                take_tokens(now.logits, now.uniforms[:, last], now.t, now.out, now.lengths, now.done, cfg,
                            now.stop_ids, pad_id, now.tools.force if now.tools is not None else None,
                            now.logps if self.logprobs else None)
                if self.agent:
                    self._finished(now.done, now.lengths, now.tools, now.out, last, episodes, batch)
            t = max(last, 0) - 1
        held = now.rows if batch.index is None else batch.index.numel()
        batch.whole(*self._head(now, held))  # the rows `now` holds written back into s
        return t + 1, row_steps

    def _head(self, s: DecodeState, n: int) -> tuple:
        out, lengths, done, logps, tools = s.head(n)
        return out, lengths, done, logps if self.logprobs else None, tools

    def _compacted(self, decoder: Backbone, now: DecodeState, batch: LiveRows, rows: int) -> DecodeState:
        """The state of `rows` rows, the same slots, holding `now`'s live rows (their outputs so far written back)."""
        held = now.rows if batch.index is None else batch.index.numel()
        keep = batch.drop(*self._head(now, held))
        small = self._state(decoder, rows, now.slots, now.uniforms.size(1), now.stop_ids.numel(), now.cache,
                            now.logits, exact=True)
        compact_into(now, small, keep)
        return small

    # ---- what decodes -----------------------------------------------------------------------------
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
        return self.refresh()

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
    def reserved_slots(self) -> int:
        """The cache positions of a compiled state made for the reserve (and any call that fits it)."""
        return -(-self.reserve // SLOT_BUCKET) * SLOT_BUCKET

    def kept_rows(self, calls: Iterable[int]) -> tuple[int, ...]:
        """The row counts a compiled engine keeps a decode state for, given its calls' row counts: each, and with
        drop_finished each count a call's live rows may move into (none: eager)."""
        if not self.compiled:
            return ()
        return tuple(sorted({r for n in calls for r in (n, *(compaction_sizes(n) if self.drop_finished else ()))}))

    def kept_bytes(self) -> int:
        """Bytes the engine holds between calls: the compiled decode states and the lower-precision weights."""
        held = [t for s in self._states.values() for t in s.tensors()]
        if self._lowered is not None:
            held += [low for _, low in self._lowered[1]]
        return sum(t.numel() * t.element_size() for t in held)


def lowered_copy(model: Backbone, masters: list[nn.Parameter], dtype: torch.dtype
                 ) -> tuple[Backbone, list[tuple[str, torch.Tensor]]]:
    """A copy of model sharing every tensor but `masters`, which it holds in dtype; with (master's name, copy)
    pairs."""
    lowering = {id(p) for p in masters}
    memo = {id(t): t for t in [*model.parameters(), *model.buffers()] if id(t) not in lowering}
    memo.update({id(p): nn.Parameter(p.detach().to(dtype), requires_grad=False) for p in masters})  # no fp32 copy
    lowered = copy.deepcopy(model, memo=memo)
    for m in lowered.modules():  # a forward set on the instance (compiled, checkpointed) calls the original's
        if getattr(m.__dict__.get("forward"), "wraps_block", False):
            del m.forward
    return lowered.eval(), [(name, memo[id(p)]) for name, p in model.named_parameters() if id(p) in lowering]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
