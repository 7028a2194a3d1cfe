"""Compiled decoding's static state: everything one decode step reads and writes, allocated once per batch shape at fixed
addresses, and the step itself (take token t, feed it back), written in place so that torch.compile captures it whole
and, on CUDA, replays it as one CUDA graph (engine.py keeps the states and runs the step)."""
from __future__ import annotations

from dataclasses import dataclass, fields

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
        cache = self.cache.k + self.cache.v + ([self.cache.prev_embedding] if self.cache.prev_embedding is not None
                                               else [])
        tools = self.tools.tensors() if self.tools is not None else []
        return cache + tools + [getattr(self, f.name) for f in fields(self) if f.name not in ("cache", "tools")]

    @property
    def slots(self) -> int:
        return self.key_valid.size(1)


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
