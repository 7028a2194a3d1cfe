"""Which rows a decode step runs and how much of their cache it reads: the batch shrinks as rows stop (eager decoding
keeps the live rows alone; compiled decoding moves them into a kept state of half the rows), and a compiled step
reads the cache's slots in use rounded up to a length bucket. `LiveRows` follows which of a call's rows the step's
tensors hold, whichever way it decodes, and writes a row's outputs back into the call's when it leaves."""
from __future__ import annotations

import torch

from nanochat_ext.engine.forcing import ToolState

# Eager decoding drops the rows that have stopped once they are this share of the batch: the step's work that grows
# with its rows (attention over each row's cache, the LM head, sampling over the vocabulary) is then the live rows'
# alone, and a long tail of a few rows costs what those rows cost. A drop copies the live rows' cache once.
DROP_FINISHED_AT = 0.25

# The fewest rows a compiled state is compacted into: a call's live rows move into a state of half its rows (a graph
# of its own per length bucket) while they fit in it, down to this many.
COMPACT_MIN_ROWS = 8

# The fewest cache slots a compiled step reads: a step reads the next power of two of this from the slots in use, so
# a call's steps run a graph per doubling of its length (4 for a 2048-slot cache) and read at most twice what they use.
READ_BUCKET = 256


def shrunk_rows(rows: int, live: int, static: bool) -> int:
    """The rows a batch of `rows` goes on with when `live` of them still decode (rows: it stays as it is). Eager
    (static False): the live rows alone, once DROP_FINISHED_AT of the batch has stopped. Compiled (static: a kept state
    a graph each): compacted_rows."""
    if static:
        return compacted_rows(rows, live)
    return live if rows - live >= DROP_FINISHED_AT * rows else rows


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


def read_length(used: int, slots: int) -> int | None:
    """The cache slots a step reads when `used` are in use (the new token's included), as KVCache.limit: a power of
    two times READ_BUCKET, None where that is all of them (the graph of a cache read whole, as before buckets)."""
    n = READ_BUCKET
    while n < used:
        n *= 2
    return n if n < slots else None


class LiveRows:
    """A call's rows as they stop and leave the batch: which of them the step's tensors hold (index; None: all, in
    order), and the call's own per-row outputs (out, lengths, done, log-probs, the tools' sampled marks), into which
    a leaving row's final values are written back."""

    def __init__(self, out: torch.Tensor, lengths: torch.Tensor, done: torch.Tensor, logps: torch.Tensor | None,
                 tools: ToolState | None):
        self.full = (out, lengths, done, logps, tools.sampled if tools is not None else None)
        self.tools = tools
        self.index: torch.Tensor | None = None

    @property
    def held(self) -> int:
        """How many of the call's rows the batch holds."""
        return self.full[0].size(0) if self.index is None else self.index.numel()

    def of(self, rows: list[int]) -> list[int]:
        """The call's rows (as the agent's episodes know them) of rows of the current batch."""
        return rows if self.index is None else self.index[rows].tolist()

    def shrink(self, out: torch.Tensor, lengths: torch.Tensor, done: torch.Tensor, logps: torch.Tensor | None,
               tools: ToolState | None) -> torch.Tensor:
        """The batch's rows' values written back, the live ones kept: their index in the current batch."""
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
