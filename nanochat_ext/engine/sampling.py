"""The sampling rules: which token a row takes from its logits and its uniform.

Randomness: each prompt has its own generator (seeded by the caller from seed, step and the prompt's global
index) that draws all its uniforms up front; tokens come from the inverse CDF of the filtered distribution. A
prompt's samples therefore do not depend on which rank or batch it sits in, and a resumed run draws exactly
what the uninterrupted run drew. The engine (engine.py) runs these rules, eagerly or inside a compiled step.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_new_tokens: int = 0  # no stop token is allowed before this many tokens


def filter_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus), as log-space logits with -inf for removed tokens."""
    logits = logits / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.size(-1):
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = cumsum_in_chunks(probs) - probs > cfg.top_p  # keep the smallest prefix reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return logits


# Cumulative sums over the vocabulary are taken in two levels, within chunks of SCAN_CHUNK tokens and over the
# chunks' totals, so that no scan runs longer than SCAN_CHUNK: inductor's split scan for one over a real
# vocabulary (65536) crashed its CUDA code generation (torch 2.11, ../shared/gpu-baseline/compile1_crash.txt).
SCAN_CHUNK = 256


def cumsum_in_chunks(x: torch.Tensor) -> torch.Tensor:
    """x.cumsum(-1) of a (B, N) tensor, summed within chunks and then over the chunks' totals (the same way
    again where there are more than SCAN_CHUNK of them): the same sums up to rounding."""
    B, N = x.shape
    if N <= SCAN_CHUNK:
        return x.cumsum(-1)
    within = F.pad(x, (0, -N % SCAN_CHUNK)).view(B, -1, SCAN_CHUNK).cumsum(-1)
    through = cumsum_in_chunks(within[:, :, -1])
    before = F.pad(through[:, :-1], (1, 0))  # each chunk's offset: the sum through the chunk before it
    return (within + before[:, :, None]).view(B, -1)[:, :N]


def sample_token(logits: torch.Tensor, u: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """One token per row: argmax at temperature 0, else inverse CDF at the row's uniform u in [0, 1): the
    first token whose cumulative probability exceeds u (never one of probability 0, which leaves the sum where it
    was), and never past the last token that adds any, where rounding puts u's point at or beyond the row's total."""
    if cfg.temperature == 0:
        return logits.argmax(-1)
    probs = F.pad(torch.softmax(filter_logits(logits.float(), cfg), dim=-1), (0, -logits.size(-1) % SCAN_CHUNK))
    cdf = cumsum_in_chunks(probs)  # whole chunks: contiguous
    # searchsorted(cdf, u * total, right=True) as two reductions that inductor fuses (its CUDA lowering of searchsorted
    # over a view of the chunked sum crashed: torch 2.11 on an H200, NotImplementedError: View): the first token
    # of probability > 0 whose sum exceeds u's point, else the last such token. Where the sums rise monotonically (CPU's
    # sequential scan) that is searchsorted's index; a GPU's parallel scan may round one sum below the one before, and
    # then too the token has probability > 0.
    index = torch.arange(probs.size(-1), device=probs.device)
    live = probs > 0
    first = torch.where(live & (cdf > u[:, None] * cdf[:, -1:]), index, probs.size(-1)).amin(-1)
    last = torch.where(live, index, 0).amax(-1)
    return torch.minimum(first, last)


def token_logprob(logits: torch.Tensor, token: torch.Tensor, temperature: float) -> torch.Tensor:
    """Each row's log-prob of its token (B,) under softmax(logits / T) (T = 1 where sampling is greedy): the model's
    own distribution at the sampling temperature, before the sampler's filters (top-k, top-p, the stops held back),
    which is what the trainer's log-probs are (training/logprobs.py)."""
    scaled = logits.float() / (temperature or 1.0)
    return scaled.gather(1, token[:, None]).squeeze(1) - scaled.logsumexp(-1)


def take_tokens(logits: torch.Tensor, u: torch.Tensor, t: torch.Tensor, out: torch.Tensor, lengths: torch.Tensor,
                done: torch.Tensor, cfg: SamplingConfig, stop_ids: torch.Tensor, pad_id: int,
                force: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
                logps: torch.Tensor | None = None) -> torch.Tensor:
    """Token t (a 0-d tensor, so a compiled step serves every t) of every row: sampled from logits at the
    row's uniform u (force(sampled, t): the tokens forced instead, and where, see forcing.py), the pad for rows
    already stopped. Written into out; rows whose token is any of stop_ids (a 1-d tensor of ids: its values are data, so
    another set of the same size compiles nothing) stop now, marked in done and lengths; with logps (rows,
    max_new_tokens), each token's token_logprob goes to its column t (0 for a pad). All in place, but logits."""
    model_logits = logits
    if cfg.min_new_tokens:  # every stop held back, whichever would end the row
        held = torch.where(t < cfg.min_new_tokens, float("-inf"), logits.index_select(1, stop_ids))
        logits = logits.index_copy(1, stop_ids, held)
    token = sample_token(logits, u, cfg)
    forced = None
    if force is not None:
        token, forced = force(token, t)
    token = torch.where(done, pad_id, token)
    out.index_copy_(1, t.view(1), token[:, None])
    if logps is not None:
        logp = torch.where(done, 0.0, token_logprob(model_logits, token, cfg.temperature))
        logps.index_copy_(1, t.view(1), logp[:, None].to(logps.dtype))
    stopped = ~done & torch.isin(token, stop_ids)
    if forced is not None:  # a forced token is never the model's stop
        stopped &= ~forced
    lengths.masked_fill_(stopped, t + 1)
    done.logical_or_(stopped)
    return token


def sample_seed(seed: int, draw: int, prompt_index: int) -> int:
    """Seed of one prompt's sampling generator: a function of (seed, draw, prompt) only, so the samples
    do not depend on the rank or batch the prompt landed in. A draw is one prompt batch (one per step,
    more under dynamic sampling; -1 for evaluation)."""
    return int(hashlib.sha256(f"{seed}:{draw}:{prompt_index}".encode()).hexdigest()[:15], 16)
