"""Reward model (backbone + linear head on the last real token), the weighted Bradley–Terry loss
normalised over the global batch, and the scorer a trained RM scores through (loader.load_reward_model makes it).
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat_ext.data.batching import prefix_tree_rows, right_pad, truncate
from nanochat_ext.ddp_common import all_reduce_sum, get_world_size, precision
from nanochat_ext.models.backbone import Backbone
from nanochat_ext.runtime.parallel import no_sync
from nanochat_ext.tokenizer import TokenizerWrapper

WEIGHT_MODES = ("mean", "sum", "none")
RM_STATS = ("loss", "correct", "margin", "pairs", "tokens", "computed")  # what rm_backward returns, in order


class RewardModel(nn.Module):
    def __init__(self, backbone: Backbone):
        super().__init__()
        self.backbone = backbone
        # No bias: it cancels in r_chosen - r_rejected, so its gradient is rounding noise that Adam
        # would scale up into lr-sized drift.
        self.head = nn.Linear(backbone.hidden_size, 1, bias=False)

    def init_head(self, seed: int) -> None:
        """N(0, 1/hidden), drawn on CPU from `seed` and copied to the head's device: the same head for a seed
        on CPU and CUDA (a CPU generator cannot fill a CUDA tensor)."""
        g = torch.Generator().manual_seed(seed)
        draw = torch.empty(self.head.weight.shape).normal_(0.0, self.backbone.hidden_size ** -0.5, generator=g)
        with torch.no_grad():
            self.head.weight.copy_(draw)

    @property
    def backbone_frozen(self) -> bool:
        return not any(p.requires_grad for p in self.backbone.parameters())

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Rewards of right-padded rows, each read at a last real token. lengths (N,): one sequence per
        row, (N,) rewards. Or lengths (B, 1 + K): PrefixTree rows, a shared prefix then K branches (a
        pair's prompt, chosen and rejected, see collate_pairs): (K * B,) rewards, branch by branch
        (the B chosen, then the B rejected). No attention mask: attention is causal, so pads after that
        token cannot reach it."""
        frozen = contextlib.nullcontext() if not self.backbone_frozen else torch.no_grad()
        with frozen:  # the last block runs at the scored positions only
            if lengths.dim() == 2:
                last = self.backbone.branch_states(input_ids, lengths).transpose(0, 1).flatten(0, 1)
            else:
                last = self.backbone.hidden_states(input_ids, at=lengths - 1)
        return self.head(last.float()).squeeze(-1)


def effective_weights(weights: torch.Tensor, mode: str, cap: float | None) -> torch.Tensor:
    """Per-pair weights as the loss uses them: capped in 'mean'/'sum', all ones in 'none'."""
    if mode == "none":
        return torch.ones_like(weights)
    return weights.clamp(max=cap) if cap is not None else weights


def loss_normaliser(weights: torch.Tensor, mode: str, cap: float | None) -> torch.Tensor:
    """This rank's share of the denominator: sum of effective weights ('mean') or the pair count."""
    if mode == "mean":
        return effective_weights(weights, mode, cap).sum().double()
    return torch.tensor(float(weights.numel()), dtype=torch.float64)


def bradley_terry_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor, weights: torch.Tensor, mode: str,
                       cap: float | None, normaliser: float) -> torch.Tensor:
    """sum_i w_i * -log sigmoid(r_c - r_r) / normaliser, the normaliser summed over the global batch
    before any backward, so the loss of a global batch does not depend on how it was split."""
    w = effective_weights(weights.to(r_chosen.device), mode, cap)
    return (w * -F.logsigmoid(r_chosen - r_rejected)).sum() / normaliser


def trainable_state(model: RewardModel, weights: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The head plus every backbone tensor that trains (the frozen rest is reloaded from its source): the model's
    own, or those of `weights`, its state dict gathered whole from a sharded model."""
    names = [n for n, p in model.named_parameters() if p.requires_grad or n.startswith("head.")]
    own = dict(model.named_parameters()) if weights is None else weights
    return {n: own[n].detach().cpu().clone() for n in names}


class RewardScorer:
    """A trained reward model, ready to score (prompt, response) pairs in the precision it was trained
    in (dtype: its matmul dtype; bf16 means frozen weights in bf16 under bf16 autocast, as in training)."""

    def __init__(self, model: RewardModel, tokenizer: TokenizerWrapper, max_len: int, meta: dict,
                 dtype: torch.dtype = torch.float32, path: Path | None = None, pad_id: int | None = None):
        self.model, self.tokenizer, self.max_len, self.meta = model.eval(), tokenizer, max_len, meta
        self.dtype = dtype
        self.path = path  # the checkpoint file (or transformers dir) it was loaded from
        # A transformers classifier scores a sequence at its last token that is not its config's pad token: a
        # sequence ending in that token (a tokenizer that pads with EOS) is scored before it, as there.
        self.pad_id = pad_id

    @property
    def device(self) -> torch.device:
        return self.model.head.weight.device

    @torch.no_grad()
    def score(self, prompts: list[str | list[dict]], responses: list[str], batch_size: int = 32) -> list[float]:
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        seqs = []
        for prompt, response in zip(prompts, responses):
            msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            seqs.append(truncate(self.tokenizer.render_prompt(msgs), self.tokenizer.render_response(response),
                                 self.max_len, self.tokenizer.bos_id))
        return self.score_ids(seqs, batch_size)

    @torch.no_grad()
    def score_ids(self, seqs: list[list[int]], batch_size: int = 32, group: int = 1) -> list[float]:
        """Scores of token sequences, about batch_size at a time. group > 1: consecutive runs of that
        many sequences (a prompt's samples) are each one PrefixTree row, their common prefix computed
        once where that is cheaper; the same scores."""
        if group < 1 or len(seqs) % group:
            raise ValueError(f"{len(seqs)} sequences do not split into groups of {group}")
        if self.pad_id is not None:
            seqs = [trim_trailing(s, self.pad_id) for s in seqs]
        out: list[float] = []
        step = max(1, batch_size // group) * group
        for i in range(0, len(seqs), step):
            chunk = seqs[i:i + step]
            if group == 1:
                rows, lengths = chunk, torch.tensor([len(s) for s in chunk])
            else:
                rows, lengths = prefix_tree_rows([chunk[j:j + group] for j in range(0, len(chunk), group)])
                lengths = torch.tensor(lengths)
            with precision(self.dtype, self.device):
                scores = self.model(right_pad(rows, self.tokenizer.pad_id).to(self.device), lengths.to(self.device))
            out += scores.float().view(group, -1).T.flatten().tolist()  # branch-major to sequence order
        return out


def trim_trailing(seq: list[int], token: int) -> list[int]:
    end = len(seq)
    while end > 1 and seq[end - 1] == token:
        end -= 1
    return seq[:end]


def rm_backward(model: torch.nn.Module, batches: list[dict], weight_mode: str, weight_cap: float | None,
                device: torch.device, autocast: contextlib.AbstractContextManager) -> torch.Tensor:
    """Forward + backward of one optimizer step's micro-batches on this rank (DDP syncs on the last).

    The loss denominator is summed over the whole global batch before any backward, and the loss is
    multiplied by the world size because DDP averages gradients over ranks: the accumulated gradient
    is that of the global-batch loss however the batch is split. Returns this rank's RM_STATS: loss,
    correct pairs, margin sum, pairs, tokens and computed tokens (see collate_pairs).
    """
    normaliser = all_reduce_sum(sum(loss_normaliser(b["weights"], weight_mode, weight_cap) for b in batches)).item()
    world = get_world_size()
    stats = torch.zeros(len(RM_STATS), dtype=torch.float64)
    for i, b in enumerate(batches):
        n = b["weights"].numel()
        with no_sync(model, skip_sync=i < len(batches) - 1), autocast:
            rewards = model(b["input_ids"].to(device), b["lengths"].to(device)).float()
            loss = bradley_terry_loss(rewards[:n], rewards[n:], b["weights"], weight_mode, weight_cap, normaliser)
            (loss * world).backward()
        margin = (rewards[:n] - rewards[n:]).detach().double().cpu()
        stats += torch.tensor([loss.item(), (margin > 0).sum().item(), margin.sum().item(), n,
                               b["tokens"], b["computed"]], dtype=torch.float64)
    return stats
