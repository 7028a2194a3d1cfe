"""How the rows of one generate call decode, step by step: a runner holds the call's batch (its cache, logits,
uniforms and per-row outputs), takes token t of every row and feeds it back, and gives up the rows that left (the
engine's loop, engine.py, drives either runner the same way).

- `EagerRunner`: every model; a cache made per call (prompt + new tokens; transformers' own modules grow their
  DynamicCache); the rows that stopped leave it by selecting the live ones.
- `CompiledRunner` (our models, `--compile`): the decode state of one batch shape (the KV cache, the step's buffers and
  counters, `DecodeState`) is allocated once, kept at fixed addresses (`mark_static_address`) by `KeptStates` and
  reused by later calls, and one decode step (take token t, feed it back) is a torch.compile'd function that reads
  and writes only that state, in place. A second call of the same shape then adds no graph, and on CUDA (mode
  reduce-overhead) the step is captured once as a CUDA graph and replayed: nothing it touches moves or is allocated
  between steps. The live rows move into a kept state of fewer rows (scheduler.compacted_rows).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn

from nanochat_ext.engine.forcing import ToolState
from nanochat_ext.engine.sampling import SamplingConfig, take_tokens
from nanochat_ext.engine.scheduler import compaction_sizes, read_length
from nanochat_ext.models.attention import KVCache
from nanochat_ext.models.backbone import Backbone
from nanochat_ext.models.compiled import allow_recompiles

SLOT_BUCKET = 64  # a compiled decode state's cache length is rounded up to this, so most calls reuse one


def compile_for(fn, device: torch.device):
    """fn under torch.compile as a decode step runs best on `device`, with static shapes. On a GPU: CUDA graphs
    (mode reduce-overhead). On CPU: inductor with its C++ wrapper, so a step's ~60 kernel calls run without
    Python between them (557 -> 438 us per step of 8 rows on the bench's 4-layer Llama, 2 threads)."""
    allow_recompiles()
    if device.type == "cuda":
        return torch.compile(fn, dynamic=False, mode="reduce-overhead")
    return torch.compile(fn, dynamic=False, options={"cpp_wrapper": True})


@dataclass
class Call:
    """What one generate call decodes with: the model (or the engine's copy), the prompts left-padded (key_mask False
    on padding), G samples of each, every row's uniforms, the sampling rule, the stop ids, the pad; python: nanochat's
    (python_start, python_end) ids where the step tracks its blocks; logprobs: keep each token's log-prob."""
    decoder: Backbone
    ids: torch.Tensor
    key_mask: torch.Tensor
    group: int
    uniforms: torch.Tensor
    cfg: SamplingConfig
    stop_ids: torch.Tensor
    pad_id: int
    python: tuple[int, int] | None
    logprobs: bool
    tools: bool  # the rows carry a ToolState (an engine with an agent)


class EagerRunner:
    """A call decoded eagerly: the prompts prefilled once into a cache long enough for every new token (a mask only
    where prompts are ragged, or for transformers' modules, which always take one), each prompt's cache repeated for
    its samples."""
    static = False  # the batch may take any number of rows

    def __init__(self, c: Call):
        self.c, d, n_new = c, c.decoder, c.cfg.max_new_tokens
        use_mask = not bool(c.key_mask.all()) or not d.native
        logits, self.cache = d.prefill(c.ids, c.key_mask if use_mask else None, c.ids.size(1) + n_new)
        d.repeat_cache(self.cache, c.group)
        self.logits = logits.repeat_interleave(c.group, dim=0)
        self.key_mask = c.key_mask.repeat_interleave(c.group, dim=0) if use_mask else None
        rows, device = self.logits.size(0), self.logits.device
        self.uniforms = c.uniforms
        self.out = torch.full((rows, n_new), c.pad_id, dtype=torch.long, device=device)
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.lengths = torch.full((rows,), n_new, dtype=torch.long, device=device)
        self.tools = ToolState.empty(rows, n_new, device) if c.tools else None
        self.logps = torch.zeros(rows, n_new, device=device) if c.logprobs else None
        self.steps = torch.arange(n_new, device=device)  # token t is steps[t]
        self.decodes = self.row_steps = 0

    @property
    def rows(self) -> int:
        return self.logits.size(0)

    def take(self, t: int, feed: bool) -> None:
        """Token t of every row (fed back by feed())."""
        c, live = self.c, ~self.done
        self.token = take_tokens(self.logits, self.uniforms[:, t], self.steps[t], self.out, self.lengths, self.done,
                                 c.cfg, c.stop_ids, c.pad_id, self.tools.force if self.tools is not None else None,
                                 self.logps)
        if c.python is not None:
            self.tools.track(self.token, self.steps[t], live, *c.python)

    def feed(self, t: int) -> None:
        if self.key_mask is not None:
            self.key_mask = torch.cat([self.key_mask, torch.ones_like(self.key_mask[:, :1])], dim=1)
        self.logits = self.c.decoder.decode(self.cache, self.token, self.key_mask)
        self.decodes += 1
        self.row_steps += self.token.size(0)

    def stepped(self) -> tuple:
        """(out, lengths, done, tools) of every row the step ran, as the end check and the agent read them."""
        return self.out, self.lengths, self.done, self.tools

    def head(self) -> tuple:
        """(out, lengths, done, logps, tools) of the call's rows the batch holds."""
        return self.out, self.lengths, self.done, self.logps, self.tools

    def shrink(self, keep: torch.Tensor, rows: int) -> None:
        """Go on with the rows `keep` (a 1-d index) alone."""
        self.c.decoder.select_cache(self.cache, keep)
        self.logits, self.uniforms, self.token = self.logits[keep], self.uniforms[keep], self.token[keep]
        self.out, self.lengths, self.done = self.out[keep], self.lengths[keep], self.done[keep]
        self.logps = self.logps[keep] if self.logps is not None else None
        self.key_mask = self.key_mask[keep] if self.key_mask is not None else None
        self.tools = self.tools.select(keep) if self.tools is not None else None


class CompiledRunner:
    """A call decoded by the compiled step over kept static state (KeptStates): the prompts prefilled once
    (eagerly, into a cache of their own length), then copied into the kept state of this many rows, each prompt's
    cache, logits and mask repeated for its G samples. Token t goes to cache slot P + t, and each step reads the
    cache's slots in use rounded up to a length bucket (scheduler.read_length). Every row's outputs end in the state
    the call began in (LiveRows writes them back there)."""
    static = True  # the batch's row counts are the kept states'

    def __init__(self, kept: KeptStates, c: Call):
        self.kept, self.c = kept, c
        self.now = kept.prefilled(c)
        self.held, self.start = self.now.rows, c.ids.size(1)
        self.decodes = self.row_steps = 0

    @property
    def rows(self) -> int:
        return self.now.rows

    def take(self, t: int, feed: bool) -> None:
        """Token t of every row, fed back in the same compiled step; the last token (feed False) is taken alone."""
        c, now = self.c, self.now
        if feed:
            now.cache.limit = read_length(self.start + t + 1, now.slots)
            self.kept.step(c.decoder.model, now, c.cfg, c.pad_id, c.python, c.logprobs)
            self.decodes += 1
            self.row_steps += now.rows
        else:
            take_tokens(now.logits, now.uniforms[:, t], now.t, now.out, now.lengths, now.done, c.cfg, now.stop_ids,
                        c.pad_id, now.tools.force if now.tools is not None else None,
                        now.logps if c.logprobs else None)

    def feed(self, t: int) -> None:
        """Nothing: take() fed token t back inside the step."""

    def stepped(self) -> tuple:
        """(out, lengths, done, tools) of every row the step ran: after a compaction its padding rows too (stopped,
        length 0, no block closed: never read)."""
        return self.now.out, self.now.lengths, self.now.done, self.now.tools

    def head(self) -> tuple:
        out, lengths, done, logps, tools = self.now.head(self.held)
        return out, lengths, done, logps if self.c.logprobs else None, tools

    def shrink(self, keep: torch.Tensor, rows: int) -> None:
        """Move the rows `keep` into the kept state of `rows` rows and the same slots."""
        now = self.now
        small = self.kept.state(rows, now.slots, now.uniforms.size(1), now.cache, now.logits, now.stop_ids.numel(),
                                exact=True)
        compact_into(now, small, keep)
        self.now, self.held = small, keep.numel()


class KeptStates:
    """A compiled engine's decode states, one per row count, kept between calls (so a run holds one for its
    rollouts, one for its evaluation, and one for each row count they are compacted into), and its compiled step.
    reserve: the longest prompt + new tokens any call of the run will need; a state is made that long at once, so a
    longer batch later does not rebuild it (new static addresses: a recompile and, on CUDA, a new graph recording).
    tools: the states carry a ToolState."""

    def __init__(self, reserve: int, tools: bool):
        self.reserve, self.tools = reserve, tools
        self.states: dict[int, DecodeState] = {}
        self._step = None

    def step(self, *args) -> None:
        if self._step is None:
            self._step = compile_for(decode_step, args[1].t.device)
        self._step(*args)

    @property
    def reserved_slots(self) -> int:
        """The cache positions of a state made for the reserve (and any call that fits it)."""
        return -(-self.reserve // SLOT_BUCKET) * SLOT_BUCKET

    def prefilled(self, c: Call) -> DecodeState:
        n, P = c.ids.shape
        G = c.group
        logits, prompt_cache = c.decoder.prefill(c.ids, c.key_mask, P)
        s = self.state(n * G, P + c.cfg.max_new_tokens, c.cfg.max_new_tokens, prompt_cache, logits, len(c.stop_ids))

        def fill(dst: torch.Tensor, src: torch.Tensor) -> None:  # dst's n*G rows <- src's n rows, G times each
            dst.unflatten(0, (n, G)).copy_(src.unsqueeze(1))

        for dst, src in zip(s.cache.k + s.cache.v, prompt_cache.k + prompt_cache.v):
            fill(dst[:, :, :P], src)
        if prompt_cache.prev_embedding is not None:
            fill(s.cache.prev_embedding, prompt_cache.prev_embedding)
        fill(s.logits, logits)
        s.key_valid.zero_()
        fill(s.key_valid[:, :P], c.key_mask)
        fill(s.positions, c.key_mask.sum(-1))
        s.uniforms.copy_(c.uniforms)
        s.out.fill_(c.pad_id)
        s.logps.zero_()
        s.stop_ids.copy_(c.stop_ids)
        s.lengths.fill_(c.cfg.max_new_tokens)
        s.done.zero_()
        s.t.zero_()
        s.slot.fill_(P)
        if s.tools is not None:
            s.tools.reset()
        return s

    def state(self, rows: int, needed: int, max_new: int, like: KVCache, logits: torch.Tensor, stops: int,
              exact: bool = False) -> DecodeState:
        """The kept state for `rows` rows, made (again) when there is none or it is too short for `needed` slots
        (exact: has other than `needed` slots)."""
        s = self.states.get(rows)
        if s is not None and (s.slots == needed if exact else s.slots >= needed) and s.uniforms.size(1) == max_new \
                and s.logits.shape == (rows, logits.size(1)) and s.cache.k[0].dtype == like.k[0].dtype \
                and len(s.stop_ids) == stops:
            return s
        self.states.pop(rows, None)  # freed before the larger one is made
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
                        ToolState.empty(rows, max_new, device) if self.tools else None)
        cache.slot = s.slot
        for t in s.tensors():
            torch._dynamo.mark_static_address(t)
        self.states[rows] = s
        return s

    def kept_rows(self, calls: Iterable[int], compacting: bool) -> tuple[int, ...]:
        """The row counts a state is kept for, given the calls' row counts: each, and with compacting each count
        a call's live rows may move into."""
        return tuple(sorted({r for n in calls for r in (n, *(compaction_sizes(n) if compacting else ()))}))

    def tensors(self) -> list[torch.Tensor]:
        return [t for s in self.states.values() for t in s.tensors()]


@dataclass
class DecodeState:
    """Everything a compiled decode step reads and writes, for `rows` rows and `slots` cache positions; token t
    of the call goes to cache slot `slot` (= prompt length + t)."""
    cache: KVCache
    logits: torch.Tensor  # (rows, V): the logits token t is drawn from
    uniforms: torch.Tensor  # (rows, max_new_tokens)
    out: torch.Tensor  # (rows, max_new_tokens) tokens taken, pads after a row's stop
    logps: torch.Tensor  # (rows, max_new_tokens) their log-probs (sampling.token_logprob), where the engine keeps them
    stop_ids: torch.Tensor  # (stops,) the ids that end a row
    lengths: torch.Tensor  # (rows,)
    done: torch.Tensor  # (rows,)
    positions: torch.Tensor  # (rows,) each row's position for token 0: its prompt's real tokens
    key_valid: torch.Tensor  # (rows, slots): the slots each row may attend to
    t: torch.Tensor  # () the token being taken
    slot: torch.Tensor  # (1,) the slot it is written to
    tools: ToolState | None  # the rows' tool calls (an engine with tools)

    def tensors(self) -> list[torch.Tensor]:
        return self.row_tensors() + [self.stop_ids, self.t, self.slot]

    @property
    def slots(self) -> int:
        return self.key_valid.size(1)

    @property
    def rows(self) -> int:
        return self.logits.size(0)

    def row_tensors(self) -> list[torch.Tensor]:
        """Every tensor with a row per row (the cache's, the tools' state), in a fixed order."""
        cache = self.cache.k + self.cache.v + ([self.cache.prev_embedding] if self.cache.prev_embedding is not None
                                               else [])
        return cache + (self.tools.tensors() if self.tools is not None else []) + [
            self.logits, self.uniforms, self.out, self.logps, self.lengths, self.done, self.positions, self.key_valid]

    def head(self, n: int) -> tuple:
        """(out, lengths, done, logps, tools) of its first n rows, as views."""
        tools = ToolState(*(x[:n] for x in self.tools.tensors())) if self.tools is not None else None
        return self.out[:n], self.lengths[:n], self.done[:n], self.logps[:n], tools


def compact_into(src: DecodeState, dst: DecodeState, rows: torch.Tensor) -> None:
    """dst (fewer rows, the same slots) takes src's rows `rows` (a 1-d index) as its first rows, everything a step
    reads included; its rows after them are copies of the first, stopped and ended (lengths 0, no block closed),
    decoded with the others and never read."""
    fill = torch.cat([rows, rows[:1].expand(dst.rows - rows.numel())])
    for d, s in zip(dst.row_tensors(), src.row_tensors()):
        torch.index_select(s, 0, fill, out=d)
    for d, s in ((dst.stop_ids, src.stop_ids), (dst.t, src.t), (dst.slot, src.slot)):
        d.copy_(s)
    padding = slice(rows.numel(), None)
    dst.done[padding], dst.lengths[padding] = True, 0
    if dst.tools is not None:
        dst.tools.closed[padding] = False


def decode_step(decoder: nn.Module, s: DecodeState, cfg: SamplingConfig, pad_id: int,
                python: tuple[int, int] | None, logprobs: bool = False) -> None:
    """Take token t of every row from the state's logits (or a forced token), decode it at its slot (static
    shapes) attending over the cache's first s.cache.limit slots (a length bucket: a graph each), and leave the
    logits after it; everything in place, so torch.compile captures the whole step, sampling
    and the tools' state included. python: nanochat's (python_start, python_end) ids, where calls are its blocks.
    logprobs: each token's log-prob into s.logps too."""
    u = s.uniforms.index_select(1, s.t.view(1)).squeeze(1)
    live = ~s.done
    token = take_tokens(s.logits, u, s.t, s.out, s.lengths, s.done, cfg, s.stop_ids, pad_id,
                        s.tools.force if s.tools is not None else None, s.logps if logprobs else None)
    if python is not None:
        s.tools.track(token, s.t, live, *python)
    s.key_valid.index_fill_(1, s.slot, True)
    s.logits.copy_(decoder.decode_step(token, s.positions + s.t, s.key_valid[:, :s.cache.limit], s.cache))
    s.t.add_(1)
    s.slot.add_(1)
