"""Batched sampling with a KV cache: prompts are left-padded and prefilled once, each prompt's cache
is repeated for its group of samples, then all rows decode in lockstep until every row has stopped.

Randomness: each prompt has its own generator (seeded by the caller from seed, step and the
prompt's global index) that draws all its uniforms up front; tokens come from the inverse CDF of
the filtered distribution. A prompt's samples therefore do not depend on which rank or batch it
sits in, and a resumed run draws exactly what the uninterrupted run drew.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass

import torch

from nanochat_ext.backbone import Backbone


@dataclass
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_new_tokens: int = 0  # the stop token is not allowed before this many tokens
    compile: bool = False  # our models: decode with a torch.compile'd static-shape step (same tokens)


# --compile auto, on CPU: the cold compiles (training's batch shape, ~18 s, and evaluation's) cost ~30 s
# in a measured run and save 0.4-0.55 ms per decoded token step (2-core CPU, the bench's 4-layer Llama):
# break-even at 55-75k token steps (bench/RESULTS.md). Both scale with the number of layers, so the
# ratio holds for deeper models.
COMPILE_PAYS_AFTER = 100_000  # max_steps x max_new_tokens


def decode_compiled(flag: str, device: torch.device, max_steps: int, max_new_tokens: int) -> tuple[bool, str]:
    """--compile: '1' and '0' as asked; 'auto' compiles the decode step on CPU when the run decodes
    enough token steps to pay back the compile, and inductor's C++ compiler is there.
    On CUDA auto stays eager: the CUDA-graph step has not been measured on a GPU yet.
    Returns (compile, why) for the log."""
    if flag in ("0", "1"):
        return flag == "1", f"--compile {flag}"
    if flag != "auto":
        raise ValueError(f"--compile must be auto, 0 or 1, got {flag!r}")
    token_steps = max_steps * max_new_tokens
    if device.type != "cpu":
        return False, f"auto: on {device.type} the compiled step is not yet measured; --compile 1 to use it"
    if token_steps < COMPILE_PAYS_AFTER:
        return False, (f"auto: {max_steps} steps x {max_new_tokens} tokens = {token_steps} token steps "
                       f"would not pay back the compile (< {COMPILE_PAYS_AFTER})")
    from torch._inductor import config as inductor

    cxx = inductor.cpp.cxx  # what inductor will try: $CXX, else g++ (clang++ on macOS)
    names = [c for c in (cxx if isinstance(cxx, (list, tuple)) else [cxx]) if c]
    if not any(shutil.which(c) for c in names):
        return False, f"auto: no C++ compiler ({' or '.join(names)}) for inductor"
    return True, f"auto: {max_steps} steps x {max_new_tokens} tokens = {token_steps} token steps pay back the compile"


def filter_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus), as log-space logits with -inf for removed tokens."""
    logits = logits / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.size(-1):
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs > cfg.top_p  # keep the smallest prefix reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return logits


def sample_token(logits: torch.Tensor, u: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """One token per row: argmax at temperature 0, else inverse CDF at the row's uniform u in [0, 1)."""
    if cfg.temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(filter_logits(logits.float(), cfg), dim=-1)
    cdf = probs.cumsum(-1)
    # right=True: the first token whose CDF exceeds u * total, never one of probability 0 (with the
    # default left side, u = 0 picked token 0 even when top-k / top-p had removed it).
    idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    return idx.clamp(max=logits.size(-1) - 1)


@dataclass
class Samples:
    completions: list[list[int]]  # one per sample (prompt-major: prompt i's samples are i*G .. i*G+G-1)
    truncated: list[bool]  # stopped by max_new_tokens, not by the stop token


def take_tokens(logits: torch.Tensor, u: torch.Tensor, t: torch.Tensor, out: torch.Tensor, lengths: torch.Tensor,
                done: torch.Tensor, cfg: SamplingConfig, stop_id: int, pad_id: int) -> torch.Tensor:
    """Token t (a 0-d tensor, so a compiled step serves every t) of every row: sampled from logits at the
    row's uniform u, the pad for rows already stopped. Written into out; rows that stop now are marked in
    done and lengths. All in place."""
    if cfg.min_new_tokens:
        logits[:, stop_id] = torch.where(t < cfg.min_new_tokens, float("-inf"), logits[:, stop_id])
    token = torch.where(done, pad_id, sample_token(logits, u, cfg))
    out.index_copy_(1, t.view(1), token[:, None])
    stopped = ~done & (token == stop_id)
    lengths.masked_fill_(stopped, t + 1)
    done.logical_or_(stopped)
    return token


def static_step(model: Backbone, cache, logits: torch.Tensor, u: torch.Tensor, t: torch.Tensor, out: torch.Tensor,
                lengths: torch.Tensor, done: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor,
                cfg: SamplingConfig, stop_id: int, pad_id: int) -> torch.Tensor:
    """Take token t from logits, then decode it at cache.slot (static shapes): the logits after it.
    torch.compile captures the whole step, sampling included."""
    token = take_tokens(logits, u, t, out, lengths, done, cfg, stop_id, pad_id)
    key_valid.index_fill_(1, cache.slot, True)
    return model.model.decode_step(token, positions + t, key_valid, cache)


@torch.no_grad()
def generate(model: Backbone, prompts: list[list[int]], group_size: int, cfg: SamplingConfig, stop_id: int,
             pad_id: int, generators: list[torch.Generator]) -> Samples:
    device = next(model.parameters()).device
    n, G, P = len(prompts), group_size, max(len(p) for p in prompts)
    ids = torch.full((n, P), pad_id, dtype=torch.long)
    key_mask = torch.zeros((n, P), dtype=torch.bool)
    for i, p in enumerate(prompts):  # left padding: every prompt ends at position P-1
        ids[i, P - len(p):] = torch.tensor(p)
        key_mask[i, P - len(p):] = True
    ids, key_mask = ids.to(device), key_mask.to(device)
    # Prompts of one length need no mask at all (our models); transformers' always takes one.
    use_mask = not bool(key_mask.all()) or not model.native
    uniforms = torch.cat([torch.rand(G, cfg.max_new_tokens, generator=g) for g in generators]).to(device)

    static = cfg.compile and model.native
    # A static cache is bucketed to a multiple of 64 slots, so new prompt lengths seldom recompile.
    cache_len = -(-(P + cfg.max_new_tokens) // 64) * 64 if static else P + cfg.max_new_tokens
    logits, cache = model.prefill(ids, key_mask if use_mask else None, cache_len)
    model.repeat_cache(cache, G)
    logits = logits.repeat_interleave(G, dim=0)
    key_mask = key_mask.repeat_interleave(G, dim=0)
    if static:
        step = model.compiled(static_step)
        key_valid = torch.zeros((n * G, cache_len), dtype=torch.bool, device=device)
        key_valid[:, :P] = key_mask
        positions = key_mask.sum(-1)  # each row's position for token 0: its prompt's real tokens
    out = torch.full((n * G, cfg.max_new_tokens), pad_id, dtype=torch.long, device=device)
    done = torch.zeros(n * G, dtype=torch.bool, device=device)
    lengths = torch.full((n * G,), cfg.max_new_tokens, dtype=torch.long, device=device)
    steps = torch.arange(cfg.max_new_tokens + P, device=device)  # token t is steps[t]; its cache slot steps[P + t]
    last = cfg.max_new_tokens - 1
    for t in range(cfg.max_new_tokens):
        if static and t < last:
            cache.slot = steps[P + t:P + t + 1]
            logits = step(model, cache, logits, uniforms[:, t], steps[t], out, lengths, done, positions, key_valid,
                          cfg, stop_id, pad_id)
        else:
            token = take_tokens(logits, uniforms[:, t], steps[t], out, lengths, done, cfg, stop_id, pad_id)
            if t == last:
                break
            if use_mask:
                key_mask = torch.cat([key_mask, torch.ones_like(key_mask[:, :1])], dim=1)
            logits = model.decode(cache, token, key_mask if use_mask else None)
        if bool(done.all()):
            break
    lengths, done = lengths.tolist(), done.tolist()
    out = out.tolist()
    return Samples([row[:k] for row, k in zip(out, lengths)], [not d for d in done])
