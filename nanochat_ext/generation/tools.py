"""Tool calls inside rollouts, as nanochat's Engine runs them (engine.py at 92d63d4): when a row's sampled
`<|python_end|>` closes a non-empty `<|python_start|>` block, the calculator evaluates the block's text, and
`<|output_start|>` + the answer's tokens + `<|output_end|>` are forced into that row, one a step, whatever the
model samples (mask 0: no loss, KL or entropy looks at them), and fed back through the model like sampled
tokens. A refused expression forces nothing. Forced tokens count towards max_new_tokens, as in nanochat.

The per-row state lives on the device, in fixed tensors: a compiled decode step takes forced tokens and tracks
python blocks inside its graph, and the host is only needed at a step where some row closed a block
(`ToolState.closed`), to run the calculator and queue its answer.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from nanochat_ext.errors import InputError
from nanochat_ext.generation.calculator import calculate
from nanochat_ext.tokenizer import TokenizerWrapper

TOOLS = ("calculator", "none")


@dataclass(frozen=True)
class ToolTokens:
    """The special tokens of nanochat's tool protocol, and the tokenizer that reads and writes the blocks."""
    python_start: int
    python_end: int
    output_start: int
    output_end: int
    tok: TokenizerWrapper

    @classmethod
    def of(cls, tok: TokenizerWrapper) -> "ToolTokens | None":
        """The protocol's tokens, where the tokenizer has nanochat's python tokens; else None."""
        try:
            return cls(*(tok.special(f"<|{name}|>") for name in ("python_start", "python_end", "output_start",
                                                                 "output_end")), tok)
        except KeyError:
            return None

    def answer(self, expr_ids: list[int]) -> list[int]:
        """The tokens forced after a block of expr_ids: the calculator's answer, or none where it refuses."""
        text = calculate(self.tok.decode(expr_ids))
        return [] if text is None else [self.output_start, *self.tok.encode(text), self.output_end]


def tool_tokens(flag: str | None, tok: TokenizerWrapper) -> ToolTokens | None:
    """--tools: the protocol to run (None: none). Default: the calculator where the tokenizer has nanochat's python
    tokens, as nanochat's Engine always runs it."""
    tools = ToolTokens.of(tok)
    if flag == "calculator" and tools is None:
        raise InputError(f"--tools calculator needs nanochat's <|python_start|> and <|output_start|> tokens, which "
                         f"the tokenizer ({tok.source}) does not have")
    return None if flag == "none" else tools


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
    def empty(cls, rows: int, max_new: int, device: torch.device) -> "ToolState":
        long = dict(dtype=torch.long, device=device)
        flag = dict(dtype=torch.bool, device=device)
        return cls(torch.zeros(rows, max_new, **long), torch.zeros(rows, **long), torch.zeros(rows, **long),
                   torch.zeros(rows, **flag), torch.zeros(rows, **long), torch.zeros(rows, **flag),
                   torch.ones(rows, max_new, **flag))

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    def reset(self) -> None:
        for t in self.tensors():
            t.zero_()
        self.sampled.fill_(True)

    def force(self, sampled: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Token t of every row: the next queued token where the row is forcing, else the sampled one."""
        forcing = self.next_forced < self.n_forced
        queued = self.forced.gather(1, self.next_forced.clamp(max=self.forced.size(1) - 1)[:, None]).squeeze(1)
        self.next_forced.add_(forcing.long())
        self.sampled.index_copy_(1, t.view(1), (~forcing)[:, None])
        return torch.where(forcing, queued, sampled)

    def track(self, token: torch.Tensor, t: torch.Tensor, live: torch.Tensor, python_start: int,
              python_end: int) -> None:
        """Follow python blocks through token t of the rows still generating (live): nanochat's state machine."""
        start = live & (token == python_start)
        end = live & (token == python_end) & self.in_block & ~start
        self.closed.copy_(end & (self.block_start < t))  # an empty block calls nothing
        self.block_start.copy_(torch.where(start, t + 1, self.block_start))
        self.in_block.copy_((self.in_block | start) & ~end)

    def answer_closed(self, out: torch.Tensor, t: int, tools: ToolTokens) -> tuple[int, int]:
        """Host: run the calculator for every row whose token t closed a block (out: the completions so far) and
        queue its answer, to be forced from token t + 1. Returns (calls, refused)."""
        rows = self.closed.nonzero().squeeze(1).tolist()
        starts = self.block_start[rows].tolist()
        refused = 0
        for row, start in zip(rows, starts):
            answer = tools.answer(out[row, start:t].tolist())[:self.forced.size(1)]
            refused += not answer
            if answer:
                self.forced[row, :len(answer)] = torch.tensor(answer, device=self.forced.device)
                self.n_forced[row] = len(answer)
                self.next_forced[row] = 0
        return len(rows), refused
