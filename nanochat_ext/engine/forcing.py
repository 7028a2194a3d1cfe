"""Tokens forced into rollouts, on the device: nanochat's tool protocol, as its Engine runs it (engine.py at 92d63d4),
and the rows' queues of forced tokens. When a row's sampled `<|python_end|>` closes a non-empty `<|python_start|>`
block, the host answers the block (agent.py: the calculator, or your tool) and `<|output_start|>` + the answer's
tokens + `<|output_end|>` are forced into that row, one a step, whatever the model samples (mask 0: no loss, KL or
entropy looks at them), and fed back through the model like sampled tokens. A refused expression forces nothing.
The turns that follow an ended assistant turn (a tool turn, an environment's message) are forced the same way.
Forced tokens count towards max_new_tokens, as in nanochat, and never end a row (a template's end-of-turn token
inside a forced tool turn is not the model's).

The per-row state lives on the device, in fixed tensors: a compiled decode step takes forced tokens and tracks
python blocks inside its graph, and the host is only needed at a step where some row closed a block
(`ToolState.closed`) or ended a turn.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from nanochat_ext.tokenizer import TokenizerWrapper


@dataclass(frozen=True)
class ToolTokens:
    """The special tokens of nanochat's tool protocol, and the tokenizer that reads and writes the blocks."""
    python_start: int
    python_end: int
    output_start: int
    output_end: int
    tok: TokenizerWrapper

    @classmethod
    def of(cls, tok: TokenizerWrapper) -> ToolTokens | None:
        """The protocol's tokens, where the tokenizer has nanochat's python tokens; else None."""
        try:
            return cls(*(tok.special(f"<|{name}|>") for name in ("python_start", "python_end", "output_start",
                                                                 "output_end")), tok)
        except KeyError:
            return None


@dataclass
class ToolState:
    """Every row's tool state during one generate call (rows, forced up to `width` tokens)."""
    forced: torch.Tensor  # (rows, width) tokens queued for the row
    n_forced: torch.Tensor  # (rows,) how many are queued
    next_forced: torch.Tensor  # (rows,) the queue's next; a row is forcing while next_forced < n_forced
    in_block: torch.Tensor  # (rows,) inside a python block
    block_start: torch.Tensor  # (rows,) the block's first expression token (index into the completion)
    closed: torch.Tensor  # (rows,) the last token closed a non-empty block: the host answers it
    sampled: torch.Tensor  # (rows, max_new_tokens) 1 where the row's token t was sampled, 0 where forced

    @classmethod
    def empty(cls, rows: int, max_new: int, device: torch.device) -> ToolState:
        long = dict(dtype=torch.long, device=device)
        flag = dict(dtype=torch.bool, device=device)
        return cls(torch.zeros(rows, max_new, **long), torch.zeros(rows, **long), torch.zeros(rows, **long),
                   torch.zeros(rows, **flag), torch.zeros(rows, **long), torch.zeros(rows, **flag),
                   torch.ones(rows, max_new, **flag))

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    def select(self, rows: torch.Tensor) -> ToolState:
        """Rows `rows` (a 1-d index) alone: eager decoding goes on without the rows that stopped."""
        return ToolState(*(t.index_select(0, rows) for t in self.tensors()))

    def reset(self) -> None:
        for t in self.tensors():
            t.zero_()
        self.sampled.fill_(True)

    def force(self, sampled: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token t of every row: the next queued token where the row is forcing, else the sampled one; and which
        rows were forced."""
        forcing = self.next_forced < self.n_forced
        queued = self.forced.gather(1, self.next_forced.clamp(max=self.forced.size(1) - 1)[:, None]).squeeze(1)
        self.next_forced.add_(forcing.long())
        self.sampled.index_copy_(1, t.view(1), (~forcing)[:, None])
        return torch.where(forcing, queued, sampled), forcing

    def track(self, token: torch.Tensor, t: torch.Tensor, live: torch.Tensor, python_start: int,
              python_end: int) -> None:
        """Follow python blocks through token t of the rows still generating (live): nanochat's state machine."""
        start = live & (token == python_start)
        end = live & (token == python_end) & self.in_block & ~start
        self.closed.copy_(end & (self.block_start < t))  # an empty block calls nothing
        self.block_start.copy_(torch.where(start, t + 1, self.block_start))
        self.in_block.copy_((self.in_block | start) & ~end)

    def closed_blocks(self, out: torch.Tensor, t: int) -> tuple[list[int], list[list[int]]]:
        """Host: the rows whose token t closed a python block, and each block's tokens (out: the completions)."""
        rows = self.closed.nonzero().squeeze(1).tolist()
        return rows, [out[row, start:t].tolist() for row, start in zip(rows, self.block_start[rows].tolist())]

    def queue(self, row: int, ids: list[int]) -> None:
        """Host: force ids into the row from its next token on (as many as fit in its queue)."""
        ids = ids[:self.forced.size(1)]
        if ids:
            self.forced[row, :len(ids)] = torch.tensor(ids, device=self.forced.device)
            self.n_forced[row] = len(ids)
            self.next_forced[row] = 0
