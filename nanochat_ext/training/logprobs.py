"""Completion log-probs, what SFT, GRPO and DPO share: prompts and completions batched as the trainers batch them (a
prompt's completions as one prefix tree, or one row each), the log-prob of every completion token (the LM head in
chunks of CHUNK_TOKENS rows, recomputed in backward, so the whole logits tensor never exists), and the backward
over a step's micro-batches with the loss normalised over the global batch.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn

from nanochat_ext.data.batching import prefix_tree_rows, right_pad
from nanochat_ext.ddp_common import all_reduce_sum, get_world_size
from nanochat_ext.models.attention import PrefixTree
from nanochat_ext.models.backbone import Backbone, hold_frozen_in, tree_positions, unshare_branches
from nanochat_ext.runtime.parallel import no_sync

# ---- batches ------------------------------------------------------------------------------------
LAYOUTS = ("row", "completion", "token")


def per(kind: str, default=None):
    """A batch field's layout, which slicing reads: "row" (one per sequence row: per group with shared prompts, else
    per completion; Sequences' input_ids and branches alone), "completion" (one per completion), "token" (one per
    completion token, (n, T); or (n,) where a trainer keeps one value per completion, e.g. GRPO's advantages)."""
    if kind not in LAYOUTS:
        raise ValueError(f"a batch field's layout is one of {LAYOUTS}, not {kind!r}")
    return field(default=default, metadata={"per": kind})


@dataclass(slots=True, eq=False)  # eq: tensors have no truth value
class Sequences:
    """Right-padded prompt+completion rows (make_sequences) and, per completion token, the position in its own
    prompt+completion sequence whose logits predict it (gather), the token itself (target) and whether a loss looks
    at it (mask). branches: with shared prompts, each group row's PrefixTree lengths (groups, 1 + G). A trainer that
    carries more per completion or per token (GRPO's RolloutBatch, DPO's PairBatch) adds fields declared with per()."""
    input_ids: torch.Tensor = per("row")
    gather: torch.Tensor = per("token")
    target: torch.Tensor = per("token")
    mask: torch.Tensor = per("token")
    branches: torch.Tensor | None = per("row")

    @classmethod
    def of(cls, sequences: Sequences, **extra):
        """`sequences`' Sequences fields with a trainer's own (cls's) added (a subclass's own fields of `sequences`
        are not carried)."""
        return cls(**{f.name: getattr(sequences, f.name) for f in fields(Sequences)}, **extra)

    def micro_batch(self, rows: slice):
        """Completions `rows` (whole groups when prompts are shared), cut to their own longest sequence and
        completion: every per-token field to the token columns a completion is scored at."""
        scored = self.mask[rows].gt(0).any(0).nonzero()  # token columns a completion is scored at (forced ones not)
        n_tok = int(scored.max().item()) + 1 if scored.numel() else 1
        out = {}
        for f in fields(self):
            value, kind = getattr(self, f.name), f.metadata["per"]
            if kind == "row" and f.name not in ("input_ids", "branches"):
                raise TypeError(f"{type(self).__name__}.{f.name}: only input_ids and branches are per row")
            if value is None or kind == "row":
                continue
            value = value[rows]
            out[f.name] = value[:, :n_tok] if kind == "token" and value.dim() == 2 else value
        if self.branches is not None:
            G = self.branches.size(1) - 1
            if rows.start % G or (rows.stop < self.mask.size(0) and rows.stop % G):
                raise ValueError(f"completions {rows.start}..{rows.stop} split a group of {G}")
            groups = slice(rows.start // G, -(-rows.stop // G))
            out["branches"] = self.branches[groups]
            T = int(out["branches"].sum(-1).max())
        else:
            groups = rows
            T = int(out["gather"].max().item()) + 1  # hidden states are needed up to the last gathered position
        out["input_ids"] = self.input_ids[groups][:, :T]
        return type(self)(**out)

    def to(self, device: torch.device):
        """Every tensor on `device`."""
        return type(self)(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                             for f in fields(self)})

    @property
    def n_completions(self) -> int:
        return self.mask.size(0)


def make_sequences(prompt_ids: list[list[int]], completions: list[list[int]], group_size: int,
                   pad_id: int, share_prompt: bool = False,
                   token_mask: list[list[int]] | None = None) -> Sequences:
    """Completion r after prompt r // group_size, as Sequences: mask is 0 past each completion's end, and where
    token_mask is 0 (a token a tool wrote: no loss looks at it). share_prompt: one PrefixTree row per group instead
    (what its sequences share, the prompt at least, once; then the rest of each), its lengths in `branches`;
    CompletionLogprobs then maps gather into the group's row."""
    seqs = [prompt_ids[r // group_size] + comp for r, comp in enumerate(completions)]
    n, L = len(completions), max(1, max(len(c) for c in completions))
    gather = torch.zeros((n, L), dtype=torch.long)
    target = torch.full((n, L), pad_id, dtype=torch.long)
    mask = torch.zeros((n, L), dtype=torch.float32)
    for r, (seq, comp) in enumerate(zip(seqs, completions)):
        k = len(comp)
        gather[r, :k] = torch.arange(len(seq) - k - 1, len(seq) - 1)
        target[r, :k] = torch.tensor(comp, dtype=torch.long)
        mask[r, :k] = 1.0 if token_mask is None else torch.tensor(token_mask[r], dtype=torch.float32)
    if not share_prompt:
        return Sequences(right_pad(seqs, pad_id), gather, target, mask)
    rows, branches = prefix_tree_rows([seqs[j:j + group_size] for j in range(0, n, group_size)])
    return Sequences(right_pad(rows, pad_id), gather, target, mask, torch.tensor(branches, dtype=torch.long))


CHUNK_TOKENS = 4096  # LM-head rows computed at once (token_logprobs_chunked)


class CompletionLogprobs(nn.Module):
    """Log-probabilities (and entropies) of completion tokens under a backbone. This is the module
    DDP wraps for the policy; the frozen reference uses it too. The LM head only runs at the
    completion positions, never over the prompt.

    temperature: the distribution the completions were sampled from, softmax(logits / T). The ratio,
    the KL and the entropy must use that one (as TRL does), or the policy gradient is biased at T != 1."""

    def __init__(self, backbone: Backbone, chunk_tokens: int = CHUNK_TOKENS, temperature: float = 1.0):
        super().__init__()
        if not temperature > 0:
            raise ValueError(f"log-probs need a temperature > 0, got {temperature}")
        _ = backbone.head_transform  # a model whose logits cannot be computed per chunk stops here, before training
        self.backbone = backbone
        self.chunk_tokens = chunk_tokens  # LM-head rows computed at once (see token_logprobs_chunked)
        self.temperature = temperature

    def forward(self, input_ids: torch.Tensor, gather: torch.Tensor, target: torch.Tensor,
                branches: torch.Tensor | None = None):
        """branches: the group rows' PrefixTree lengths (make_sequences with share_prompt): completion n
        is branch n % G of row n // G. Where a tree does not pay (Backbone.shares_prefixes) each
        prompt+completion runs as a row of its own."""
        if branches is not None and self.backbone.shares_prefixes(branches):
            hidden = self.backbone.hidden_states(input_ids, tree=PrefixTree.from_lengths(branches, input_ids.device))
            group_row = torch.arange(gather.size(0), device=gather.device) // (branches.size(1) - 1)
            h = hidden[group_row[:, None], tree_positions(gather, branches)]
        else:
            if branches is not None:
                input_ids = unshare_branches(input_ids, branches)[0]
            hidden = self.backbone.hidden_states(input_ids)
            h = hidden.gather(1, gather.unsqueeze(-1).expand(-1, -1, hidden.size(-1)))
        return token_logprobs_chunked(self.backbone.logits, h, target, self.chunk_tokens, self.temperature,
                                      compiled=self.backbone.compiled)


def _chunk_logprobs(logits_fn, h: torch.Tensor, target: torch.Tensor,
                    temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(logits_fn(h).float() / temperature, dim=-1)
    token_logp = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return token_logp, entropy


_compiled_chunks: dict[str, object] = {}  # torch.compile's backend -> _chunk_logprobs under it


def chunk_logprobs_fn(backend: str | None):
    """_chunk_logprobs eager (None) or under torch.compile with that backend. Compiled, the LM head's chain (matmul,
    softcap, cast, temperature, log-softmax, gather, entropy: ~8 passes over a chunk's vocabulary-sized logits)
    fuses into a few kernels: forward 2.1x and forward + backward 1.45x faster on CPU for 2048 rows, a 65536
    vocabulary and 768 hidden (bench/bench_lm_head.py, bench/RESULTS.md). Symbolic sizes: chunks and micro-batches of
    any row count share one graph."""
    if backend is None:
        return _chunk_logprobs
    if backend not in _compiled_chunks:
        _compiled_chunks[backend] = torch.compile(_chunk_logprobs, dynamic=True, backend=backend)
    return _compiled_chunks[backend]


def _fresh_inputs(chunk, logits_fn, h: torch.Tensor, target: torch.Tensor, temperature: float):
    return chunk(logits_fn, h.clone(), target.clone(), temperature)


def token_logprobs_chunked(logits_fn, h: torch.Tensor, target: torch.Tensor, chunk_tokens: int,
                           temperature: float = 1.0, compiled: str | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of `target` (B, L) under logits_fn(h) with h (B, L, H), never holding more
    than chunk_tokens rows of vocabulary-sized logits: 256 completions x 512 tokens x a 65k vocabulary
    would be 34 GB in fp32. Under autograd each chunk is recomputed in the backward pass
    (activation checkpointing), so its logits are not kept either. The values of one big chunk, up to
    rounding: the LM-head matmul blocks its reductions by the chunk's row count. compiled: torch.compile's
    backend for each chunk's chain (chunk_logprobs_fn), None: eager."""
    B, L, H = h.shape
    flat_h, flat_t = h.reshape(B * L, H), target.reshape(B * L)
    chunk = chunk_logprobs_fn(compiled)
    # a view's guards include its base's sizes: fresh tensors (H columns: cheap) share one graph
    if compiled is not None:
        chunk = functools.partial(_fresh_inputs, chunk)
    if B * L <= chunk_tokens:
        token_logp, entropy = chunk(logits_fn, flat_h, flat_t, temperature)
        return token_logp.view(B, L), entropy.view(B, L)
    from torch.utils.checkpoint import checkpoint

    parts = []
    for a in range(0, B * L, chunk_tokens):
        hc, tc = flat_h[a:a + chunk_tokens], flat_t[a:a + chunk_tokens]
        if torch.is_grad_enabled() and hc.requires_grad:
            parts.append(checkpoint(chunk, logits_fn, hc, tc, temperature, use_reentrant=False))
        else:
            parts.append(chunk(logits_fn, hc, tc, temperature))
    return (torch.cat([p[0] for p in parts]).view(B, L), torch.cat([p[1] for p in parts]).view(B, L))


def accumulate_backward(model: nn.Module, batch: Sequences, micro: int, device: torch.device,
                        autocast: contextlib.AbstractContextManager, loss_fn) -> torch.Tensor:
    """Forward + backward over this rank's sequences in micro-batches of `micro` (DDP syncs on the
    last one). loss_fn(b, logp, entropy) -> (loss already divided by a global normaliser, stats); the
    loss is scaled by the world size because DDP averages gradients. Every rank runs the same number
    of micro-batches, so the collectives line up whatever the completion lengths. Returns the summed
    [loss, *stats]."""
    world = get_world_size()
    starts = list(range(0, batch.n_completions, micro))  # completions (input_ids may hold group rows)
    total = None
    for k, a in enumerate(starts):
        b = batch.micro_batch(slice(a, a + micro)).to(device)
        with no_sync(model, skip_sync=k < len(starts) - 1), autocast:
            logp, entropy = model(b.input_ids, b.gather, b.target, b.branches)
            loss, stats = loss_fn(b, logp, entropy)
            (loss * world).backward()
        row = torch.cat([loss.detach().double().cpu().view(1), stats])
        total = row if total is None else total + row
    return total


def sft_backward(model: nn.Module, batch: Sequences, micro: int, device: torch.device,
                 autocast: contextlib.AbstractContextManager) -> torch.Tensor:
    """Supervised fine-tuning step: mean negative log-likelihood of the reply tokens over the global
    batch. Returns [loss, tokens]."""
    normaliser = max(all_reduce_sum(batch.mask.sum().double()).item(), 1.0)

    def loss_fn(b, logp, entropy):
        return -(logp * b.mask).sum() / normaliser, b.mask.sum().double().cpu().view(1)

    return accumulate_backward(model, batch, micro, device, autocast, loss_fn)


@torch.no_grad()
def token_logprobs(model: CompletionLogprobs, batch: Sequences, micro: int, device: torch.device,
                   autocast: contextlib.AbstractContextManager) -> torch.Tensor:
    """Log-probs of every completion token, without grad (reference model, or the old policy)."""
    n, L = batch.target.shape
    out = torch.zeros(n, L)
    for a in range(0, n, micro):
        b = batch.micro_batch(slice(a, a + micro))
        with autocast:  # branches on any device: the model places them (PrefixTree.from_lengths, tree_positions)
            logp, _ = model(b.input_ids.to(device), b.gather.to(device), b.target.to(device), b.branches)
        out[a:a + micro, :logp.size(1)] = logp.float().cpu()
    return out


def reference_model(backbone: Backbone, dtype: torch.dtype, *, temperature: float = 1.0,
                    chunk_tokens: int = CHUNK_TOKENS, matmuls_only: bool = True) -> CompletionLogprobs:
    """GRPO's frozen reference: the policy's weights through the policy's own code and precision (only
    linear weights held in `dtype`, see hold_frozen_in), so that at equal weights its log-probs are the
    policy's bitwise and the KL term is exactly 0. temperature and chunk_tokens: the policy's
    CompletionLogprobs' own (the LM head's chunking sets its rounding). matmuls_only False: every weight in
    dtype, as an FSDP policy gathers them in bf16 (parallel.Parallel.gathers_in)."""
    frozen = hold_frozen_in(backbone.requires_grad_(False), dtype, matmuls_only=matmuls_only)
    return CompletionLogprobs(frozen, chunk_tokens, temperature)
