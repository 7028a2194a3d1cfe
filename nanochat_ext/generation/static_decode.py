"""Compiled decoding's static state: everything one decode step reads and writes, allocated once per batch shape at fixed
addresses, and the step itself (take token t, feed it back), written in place so that torch.compile captures it whole
and, on CUDA, replays it as one CUDA graph (engine.py keeps the states and runs the step); what a step reads as the
rows lengthen (length buckets) and as they stop (a smaller state); and the rows a call still decodes, which eager
and compiled decoding both drop as they stop (LiveRows)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from nanochat_ext.generation.sampling import SamplingConfig, take_tokens
from nanochat_ext.generation.tools import ToolState
from nanochat_ext.models.attention import KVCache
from nanochat_ext.models.compiled import allow_recompiles


def compile_for(fn, device: torch.device):
    """fn under torch.compile as a decode step runs best on `device`, with static shapes. On a GPU: CUDA graphs
    (mode reduce-overhead). On CPU: inductor with its C++ wrapper, so a step's ~60 kernel calls run without
    Python between them (557 -> 438 us per step of 8 rows on the bench's 4-layer Llama, 2 threads)."""
    allow_recompiles()
    if device.type == "cuda":
        return torch.compile(fn, dynamic=False, mode="reduce-overhead")
    return torch.compile(fn, dynamic=False, options={"cpp_wrapper": True})


# The fewest cache slots a compiled step reads: a step reads the next power of two of this from the slots in use, so
# a call's steps run a graph per doubling of its length (4 for a 2048-slot cache) and read at most twice what they use.
READ_BUCKET = 256


def read_length(used: int, slots: int) -> int | None:
    """The cache slots a step reads when `used` are in use (the new token's included), as KVCache.limit: a power of
    two times READ_BUCKET, None where that is all of them (the graph of a cache read whole, as before buckets)."""
    n = READ_BUCKET
    while n < used:
        n *= 2
    return n if n < slots else None


# The fewest rows a compiled state is compacted into: a call's live rows move into a state of half its rows (a graph
# of its own per length bucket) while they fit in it, down to this many.
COMPACT_MIN_ROWS = 8


def compacted_rows(rows: int, live: int) -> int:
    """The rows of the state a call of `rows` rows goes on in when `live` of them are still decoding: halved while
    the live rows fit in the half, not below COMPACT_MIN_ROWS (rows itself: no compaction)."""
    while rows % 2 == 0 and live <= rows // 2 and rows // 2 >= COMPACT_MIN_ROWS:
        rows //= 2
    return rows


def compaction_sizes(rows: int) -> list[int]:
    """Every row count a call of `rows` rows may be compacted into (a state is kept for each it reaches)."""
    sizes = []
    while compacted_rows(rows, 0) != rows:
        rows //= 2
        sizes.append(rows)
    return sizes


class LiveRows:
    """Eager decoding's batch as rows stop and are dropped: which of the call's rows the step's tensors hold (None:
    all), and the call's own per-row outputs (out, lengths, done, log-probs, the tools' sampled marks), into which a
    dropped row's final values are written back."""

    def __init__(self, out: torch.Tensor, lengths: torch.Tensor, done: torch.Tensor, logps: torch.Tensor | None,
                 tools: ToolState | None):
        self.full = (out, lengths, done, logps, tools.sampled if tools is not None else None)
        self.tools = tools
        self.index: torch.Tensor | None = None
        self.row_steps = 0  # rows decoded, summed over the steps

    def of(self, rows: list[int]) -> list[int]:
        """The call's rows (as the agent's episodes know them) of rows of the current batch."""
        return rows if self.index is None else self.index[rows].tolist()

    def drop(self, out: torch.Tensor, lengths: torch.Tensor, done: torch.Tensor, logps: torch.Tensor | None,
             tools: ToolState | None) -> torch.Tensor:
        """Write the rows' values back, keep the live ones; returns their index in the current batch."""
        self.whole(out, lengths, done, logps, tools)
        keep = (~done).nonzero().squeeze(1)
        self.index = keep if self.index is None else self.index[keep]
        return keep

    def whole(self, out: torch.Tensor, lengths: torch.Tensor, done: torch.Tensor, logps: torch.Tensor | None,
              tools: ToolState | None) -> tuple:
        """The call's out, lengths, done, log-probs and tool state, with the current rows' values in place."""
        if self.index is None:
            return out, lengths, done, logps, tools
        now = (out, lengths, done, logps, tools.sampled if tools is not None else None)
        for dst, src in zip(self.full, now):
            if dst is not None:
                dst.index_copy_(0, self.index, src)
        return (*self.full[:4], self.tools)


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
