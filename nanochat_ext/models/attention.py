"""Attention over the rows our models see, shared by the nanochat GPT (gpt.py) and the Llama family
(llama.py): positions and masks of left-padded rows, prefix-tree rows (a shared prefix computed once
for K branches), the static-cache masks of compiled decoding, and the KV cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

NO_WINDOW = 1 << 30  # a window no sequence reaches: full causal attention


def row_positions(key_mask: torch.Tensor | None, T0: int, T: int) -> torch.Tensor | None:
    """Positions (B, T) of the T tokens after T0 cached ones, counting only real tokens, so that a
    left-padded row's first real token sits at position 0 and the row computes exactly what it would
    unpadded. None when there is no padding: every row is at T0..T0+T-1."""
    if key_mask is None:
        return None
    if T == 1:  # one decoded token: its position is the number of real tokens before it
        return key_mask.sum(-1, keepdim=True) - 1
    return (key_mask.long().cumsum(-1)[:, T0:T0 + T] - 1).clamp(min=0)


def rotary_slice(table: torch.Tensor, positions: torch.Tensor | None, T0: int, T: int) -> torch.Tensor:
    """Rows of a (L, ...) rotary table for the new tokens: (1, T, ...) shared, or (B, T, ...) per row."""
    if positions is None:
        return table[T0:T0 + T][None]
    return table[positions]


def rows_at(t: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """Row b's entries at positions at[b] (B, K) of a (B or 1, T, ...) tensor, as (B, K, ...)."""
    t = t.expand(at.size(0), *t.shape[1:])
    return t[torch.arange(at.size(0), device=t.device)[:, None], at]


def mask_at(at: torch.Tensor, T: int, window: int) -> torch.Tensor:
    """(B, 1, K, T) mask for K queries per row at positions at[b] (B, K) of right-padded rows: keys
    at[b, k] - window .. at[b, k] (the causal rule, so the pads after a row's last token are hidden)."""
    d = at[:, :, None] - torch.arange(T, device=at.device)
    return ((d >= 0) & (d <= window))[:, None]


@dataclass
class PrefixTree:
    """Right-padded rows that each hold a shared prefix once and K branches after it: a preference
    pair's prompt, then its chosen and its rejected response; a GRPO group's prompt, then its G
    completions. A branch token sees the prefix and its
    own branch, at the positions it would have in a row of its own, and never another branch; so each
    branch computes exactly what prefix + branch computes alone, and the prefix is computed once.

    Attention (TreeAttention) runs the prefix causally once per row, and each branch's queries over the
    prefix and their own branch, gathered into a batch of B x K short rows: the attention work of rows
    of their own, not a dense masked T x T."""
    positions: torch.Tensor  # (B, T) each token's position on its own path; 0 on padding
    segment: torch.Tensor  # (B, T) 0: prefix, k: branch k (1..K), K + 1: padding
    prev: torch.Tensor  # (B, T) index of each token's predecessor on its path (a branch's first: the prefix's last)
    ends: torch.Tensor  # (B, K) index of each branch's last token
    branch_rows: torch.Tensor  # (B, K, Lm) row index of branch k's j-th token; -1 past the branch's end
    prefix_lengths: torch.Tensor  # (B,)
    span: int  # longest path (prefix + one branch) of any row: the positions a model must cover
    real_tokens: torch.Tensor | None  # (N,) the (B * T) positions that are not pads, for add_mlp; None: too few

    @classmethod
    def from_lengths(cls, lengths: torch.Tensor, device: torch.device | str = "cpu") -> PrefixTree:
        """lengths (B, 1 + K): each row's prefix length, then its K branch lengths (each >= 1). The tree is
        built on the CPU (a handful of small ops) and moved to `device`."""
        lengths = lengths.cpu()
        if lengths.size(1) < 2 or bool((lengths[:, 1:] < 1).any()) or bool((lengths[:, 0] < 0).any()):
            raise ValueError(f"prefix-tree lengths need a prefix >= 0 and branches >= 1, got {lengths.tolist()}")
        bounds = lengths.cumsum(-1)  # (B, 1 + K): where the prefix and each branch end
        T, K = int(bounds[:, -1].max()), lengths.size(1) - 1
        idx = torch.arange(T)
        segment = (idx[None, :, None] >= bounds[:, None, :]).sum(-1)
        starts = torch.cat([torch.zeros_like(bounds[:, :1]), bounds], -1).gather(1, segment)
        prefix = lengths[:, :1]
        positions = torch.where(segment == 0, idx, prefix + idx - starts).masked_fill(segment > K, 0)
        prev = torch.where((segment > 0) & (idx == starts), prefix - 1, idx - 1).clamp(min=0)
        j = torch.arange(int(lengths[:, 1:].max()))
        branch_rows = torch.where(j < lengths[:, 1:, None], bounds[:, :-1, None] + j, -1)
        span = int((lengths[:, 0] + lengths[:, 1:].max(-1).values).max())
        # The MLP runs on the real tokens alone (add_mlp) when the pads are 1/16 of the tokens or more:
        # picking and putting back cost ~3% of an MLP's time (hidden 128, 2 threads); 17% pads saved ~20%.
        real = (segment <= K).flatten().nonzero().squeeze(1)
        real = real.to(device) if (segment.numel() - real.numel()) * 16 >= segment.numel() else None
        tensors = (positions, segment, prev, bounds[:, 1:] - 1, branch_rows, lengths[:, 0])
        return cls(*(t.to(device) for t in tensors), span, real)

    @staticmethod
    def pays(lengths: torch.Tensor, hidden_size: int) -> bool:
        """Whether prefix-tree rows (lengths as from_lengths takes them) cost fewer FLOPs than one row per
        branch. Per layer and token, the projections and MLP cost ~24 h^2; attention ~4 h per query-key
        pair: for a tree, the causal half of the longest prefix per row plus every branch (padded to the
        longest) over that prefix and itself (TreeAttention); for rows of their own, the causal half of
        each. So a tree pays unless its rows share (almost) nothing."""
        lengths = lengths.cpu().double()
        tree, own = lengths.sum(-1), lengths[:, :1] + lengths[:, 1:]
        B, K = lengths.size(0), lengths.size(1) - 1
        P, L = float(lengths[:, 0].max()), float(lengths[:, 1:].max())
        h = float(hidden_size)
        shared = 24 * h * h * tree.sum() + 2 * h * B * P * P + 4 * h * B * K * L * (P + L)
        unshared = 24 * h * h * own.sum() + 2 * h * (own ** 2).sum()
        return bool(shared < unshared)

    def attention(self, window_sizes: list[int]) -> list[TreeAttention]:
        """Per-layer TreeAttention: causal along each token's own path, within the layer's window
        (position distance, as in `attn_masks`)."""
        B, K, Lm = self.branch_rows.shape
        Pm = int(self.prefix_lengths.max())
        device = self.branch_rows.device
        real = self.branch_rows >= 0
        T = self.segment.size(1)
        rows = self.branch_rows.clamp(min=0)  # a pad query reads row 0; its output is dropped
        prefix_keys = torch.arange(Pm, device=device).expand(B, K, Pm)
        first = torch.arange(B, device=device)[:, None, None]  # each row's first token in (B * T) tokens
        key_rows = (first * T + torch.cat([prefix_keys, rows], -1)).flatten()
        P = self.prefix_lengths[:, None, None]
        j = torch.arange(Lm, device=device)
        query_pos = (P + j)[..., None]  # (B, K, Lm, 1)
        key_pos = torch.cat([prefix_keys, (P + j).expand(B, K, Lm)], -1)[:, :, None, :]  # (B, K, 1, Pm + Lm)
        key_ok = torch.cat([prefix_keys < P, real], -1)[:, :, None, :] & (key_pos <= query_pos)
        # each query sees its own slot: no row is fully masked (some SDPA kernels give such a row NaN, and
        # a pad query reads row 0, whose gradient would take it)
        itself = torch.arange(Pm + Lm, device=device) == Pm + j[:, None]  # (Lm, Pm + Lm)
        query_rows = (first * T + rows).flatten()
        out_rows = (first * (T + 1) + torch.where(real, self.branch_rows, T)).flatten()  # pads: a dropped slot
        by_window = {}
        for w in set(window_sizes):
            ok, prefix_mask = key_ok, None
            if w < self.span:  # keys at positions >= the query's - w
                ok = ok & (key_pos >= query_pos - w)
                i = torch.arange(Pm, device=device)
                prefix_mask = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - w)
            by_window[w] = TreeAttention(prefix_mask, (ok | itself).view(B * K, 1, Lm, Pm + Lm), query_rows,
                                         out_rows, key_rows, Pm)
        return [by_window[w] for w in window_sizes]

    def rows_mask(self, at: torch.Tensor, window: int) -> torch.Tensor:
        """(B, 1, K, T) mask for queries at row positions at (B, K) alone (the scored path), over the whole
        row: the prefix and the query's own branch up to it, within the window."""
        T = self.segment.size(1)
        query_seg = self.segment.gather(1, at)[..., None]  # (B, K, 1)
        key_seg = self.segment[:, None, :]  # (B, 1, T)
        idx = torch.arange(T, device=at.device)
        ok = ((key_seg == 0) | (key_seg == query_seg)) & (idx <= at[..., None])
        if window < self.span:
            ok = ok & (self.positions[:, None, :] >= self.positions.gather(1, at)[..., None] - window)
        return (ok | (idx == at[..., None]))[:, None]


@dataclass
class TreeAttention:
    """SDPA over PrefixTree rows, one layer's (see PrefixTree.attention): the first Pm positions of every
    row attend causally among themselves (a row's prefix; the rest of that span belongs to branches, whose
    outputs are written over it), and each branch's queries attend, as a batch of B x K rows, to the prefix
    and their own branch. Same outputs as a dense tree mask over T x T. Rows are picked from the (B * T)
    tokens of the (B, T, heads, head_dim) layout the projections made, so picking and putting back are
    one index op each and the output is that layout again."""
    prefix_mask: torch.Tensor | None  # (Pm, Pm) causal within the window; None: plain causal
    branch_mask: torch.Tensor  # (B * K, 1, Lm, Pm + Lm)
    query_rows: torch.Tensor  # (B * K * Lm,) token (b * T + row) of each branch query (pads: row 0)
    out_rows: torch.Tensor  # (B * K * Lm,) token (b * (T + 1) + row) each branch output goes to (pads: row T, dropped)
    key_rows: torch.Tensor  # (B * K * (Pm + Lm),) token of each branch's keys: the prefix, then the branch
    prefix_len: int  # Pm, the longest prefix

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        (B, H, T, D), Pm = q.shape, self.prefix_len
        BK, _, Lm, Tk = self.branch_mask.shape
        gqa = H != k.size(1)

        def take(t: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:  # (B, h, T, D) -> (B*K, h, n, D)
            h = t.size(1)
            return t.transpose(1, 2).reshape(B * T, h * D).index_select(0, rows).view(BK, n, h, D).transpose(1, 2)

        branches = F.scaled_dot_product_attention(take(q, self.query_rows, Lm), take(k, self.key_rows, Tk),
                                                  take(v, self.key_rows, Tk), attn_mask=self.branch_mask,
                                                  enable_gqa=gqa)
        out = q.new_zeros(B, T + 1 - Pm, H, D)
        if Pm:
            prefix = F.scaled_dot_product_attention(q[:, :, :Pm], k[:, :, :Pm], v[:, :, :Pm],
                                                    attn_mask=self.prefix_mask, is_causal=self.prefix_mask is None,
                                                    enable_gqa=gqa)
            out = torch.cat([prefix.transpose(1, 2), out], 1)
        out = out.reshape(B * (T + 1), H * D).index_copy(0, self.out_rows, branches.transpose(1, 2).reshape(-1, H * D))
        return out.view(B, T + 1, H, D)[:, :T].transpose(1, 2)


def static_masks(key_valid: torch.Tensor, slot: torch.Tensor, window_sizes: list[int]) -> list[torch.Tensor]:
    """Per-layer (B, 1, 1, L) masks for one new token at cache slot `slot` over a whole static cache:
    the valid slots (real tokens so far, the new one included) within the layer's window. Left padding
    is contiguous, so slot distance is position distance between a row's real tokens."""
    near = slot - torch.arange(key_valid.size(1), device=key_valid.device)
    by_window = {w: (key_valid & (near <= w))[:, None, None, :] for w in set(window_sizes)}
    return [by_window[w] for w in window_sizes]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | TreeAttention | None,
           cached: bool = False) -> torch.Tensor:
    """SDPA over (B, H, T, D) with GQA; mask None: causal when T > 1, all keys for a single query;
    a TreeAttention: prefix-tree rows (see PrefixTree). cached: k and v come from a KV cache (decoding).
    On CPU, attention outside decoding (training, the reference's and pi_old's log-probs, scoring) runs in fp32
    whatever its inputs' dtype and autocast: torch's CPU attention takes 2-4x as long forward and backward in bf16 as
    in fp32 on these shapes. It does so whether or not it trains, so that a no-grad pass gives the training pass's
    log-probs (a reference equal to the policy: KL 0). Decoding stays as autocast casts it: its forward alone is the
    faster in bf16, and it reads a bf16 cache as it would an fp32 one."""
    if not cached and q.device.type == "cpu" and (q.dtype != torch.float32 or torch.is_autocast_enabled("cpu")):
        with torch.autocast("cpu", enabled=False):  # contiguous, as autocast's casts were: inductor's backward
            # graph otherwise fixes a view's strides at the first length's (test_compiled_step_one_starts_at_its_...)
            return attend_in(*(t.float().contiguous() for t in (q, k, v)), mask).to(q.dtype)
    return attend_in(q, k, v, mask)


def attend_in(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | TreeAttention | None
              ) -> torch.Tensor:
    """attend in the inputs' dtype (or autocast's)."""
    if isinstance(mask, TreeAttention):
        return mask(q, k, v)
    gqa = q.size(1) != k.size(1)
    if mask is None and q.size(2) > 1:  # a branch, not is_causal=T > 1: compiled, T is a symbol, not a bool
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def attn_masks(window_sizes: list[int], T: int, T0: int, key_mask: torch.Tensor | None,
               device: torch.device) -> list[torch.Tensor | None]:
    """Per-layer boolean masks for queries at positions T0..T0+T-1 over keys 0..T0+T-1. None means no
    mask is needed: causal attention over the whole sequence (T0 == 0) or one new token seeing every
    cached key (T == 1), with no padding and a window that covers it all (see `attend`).
    Left padding is contiguous, so distances between a row's real tokens are the same in cache
    indices as in positions and one window rule serves padded and unpadded rows."""
    Tk = T0 + T
    masks, cache = [], {}
    for w in window_sizes:
        if key_mask is None and w >= Tk and (T0 == 0 or T == 1):
            masks.append(None)
            continue
        if w not in cache:
            i = torch.arange(T0, Tk, device=device)
            d = i[:, None] - torch.arange(Tk, device=device)[None, :]
            m = (d >= 0) & (d <= w)  # query i sees keys i-w..i (FA3's window (w, 0))
            if key_mask is not None:
                # Padding keys are hidden; a pad query still sees itself, so no row is fully masked
                # (that would be NaN, and NaN leaks through 0-weighted values).
                m = (m & key_mask[:, None, None, :Tk]) | (d == 0)
            cache[w] = m
        masks.append(cache[w])
    return masks


def layer_masks(window_sizes: list[int], T: int, T0: int, key_mask: torch.Tensor | None,
                tree: PrefixTree | None, at: torch.Tensor | None, device: torch.device) -> list:
    """Every layer's attention mask (see attn_masks) or TreeAttention (see PrefixTree); with `at` (B, K)
    the last layer's is a (B, 1, K, T) mask for the queries at those positions only."""
    if tree is None:
        masks = attn_masks(window_sizes, T, T0, key_mask, device)
        if at is not None:
            masks[-1] = mask_at(at, T, window_sizes[-1])
        return masks
    if at is None:
        return tree.attention(window_sizes)
    return tree.attention(window_sizes[:-1]) + [tree.rows_mask(at, window_sizes[-1])]


def add_mlp(x: torch.Tensor, mlp, real_tokens: torch.Tensor | None) -> torch.Tensor:
    """x + mlp(x), the MLP run only at real_tokens of the flattened (B * T) positions when given (a
    PrefixTree's): it is most of a block's work and position-wise, so right-padded rows need not pay it
    for their pads, which keep x."""
    if real_tokens is None:
        return x + mlp(x)
    flat = x.reshape(-1, x.size(-1))
    h = flat.index_select(0, real_tokens)
    return flat.index_copy(0, real_tokens, h + mlp(h)).view_as(x)


class KVCache:
    """Keys/values of every layer for a batch being decoded, a (B, n_kv_head, max_len, head_dim) tensor per
    layer, plus the last token's embedding for the smear of the next one."""

    def __init__(self, n_layer: int, batch: int, n_kv_head: int, head_dim: int, max_len: int, device, dtype):
        # dtype: the weights'. Under autocast attention reads keys and values in the autocast dtype, so the
        # cache holds that instead: half the memory of fp32 under bf16, the same attention output.
        if torch.is_autocast_enabled(torch.device(device).type):
            dtype = torch.get_autocast_dtype(torch.device(device).type)
        shape = (batch, n_kv_head, max_len, head_dim)
        # One tensor per layer: a compiled decode step then writes each layer's new position in place
        # (a slice of one stacked tensor is functionalised into a copy of the whole cache every step).
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.pos = 0  # tokens already cached
        self.slot: torch.Tensor | None = None  # (1,) where decode_step writes (static decoding only)
        self.limit: int | None = None  # static decoding: the slots a step reads (a length bucket); None: all of them
        self.prev_embedding: torch.Tensor | None = None  # (B, 1, n_embd), smear vintages only

    def insert(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Append k, v after the cached positions and return the keys and values so far; with `slot`
        set (static decoding), write the one new position at that slot and return the cache's first `limit` slots
        (all where None)."""
        if self.slot is not None:  # in the cache's dtype on purpose: a value embedding (fp32) promotes v under
            # autocast, and CUDA's autocast keeps rms_norm, so k, in fp32 (the slice writes below cast as they copy)
            self.k[layer].index_copy_(2, self.slot, k.to(self.k[layer].dtype))
            self.v[layer].index_copy_(2, self.slot, v.to(self.v[layer].dtype))
            return self.k[layer][:, :, :self.limit], self.v[layer][:, :, :self.limit]
        end = self.pos + k.size(2)
        if end > self.k[layer].size(2):
            raise ValueError(f"KV cache of {self.k[layer].size(2)} positions is full")
        self.k[layer][:, :, self.pos:end] = k
        self.v[layer][:, :, self.pos:end] = v
        if layer == len(self.k) - 1:
            self.pos = end
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def swap_embedding(self, last: torch.Tensor) -> torch.Tensor | None:
        """Keep `last` (B, 1, n_embd), the newest token's embedding, for the next token's smear; return the one
        kept before (None before the first). Static decoding writes it in place, at the buffer's fixed address."""
        before = self.prev_embedding
        if self.slot is None or before is None:
            self.prev_embedding = last
            return before
        before = before.clone()
        self.prev_embedding.copy_(last)
        return before

    def repeat_interleave(self, n: int) -> None:
        """Each row becomes n rows: a prompt prefilled once serves its n samples."""
        self.k = [k.repeat_interleave(n, dim=0) for k in self.k]
        self.v = [v.repeat_interleave(n, dim=0) for v in self.v]
        if self.prev_embedding is not None:
            self.prev_embedding = self.prev_embedding.repeat_interleave(n, dim=0)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep rows `rows` (a 1-d index) alone: decoding goes on without the rows that stopped."""
        self.k = [k.index_select(0, rows) for k in self.k]
        self.v = [v.index_select(0, rows) for v in self.v]
        if self.prev_embedding is not None:
            self.prev_embedding = self.prev_embedding.index_select(0, rows)


@dataclass
class Span:
    """Where a forward's new tokens sit, as both models' hidden_states take them (see GPT.hidden_states)."""
    T0: int  # tokens already in the cache
    positions: torch.Tensor | None  # (B, T) each new token's rotary position; None: T0..T0+T-1 in every row
    at: torch.Tensor | None  # (B, K): the positions the last block computes at; None: all
    single: bool  # `at` was given as (B,): one state per row comes back
    masks: list  # every layer's mask or TreeAttention (layer_masks)


def forward_span(idx: torch.Tensor, key_mask: torch.Tensor | None, kv_cache: KVCache | None,
                 tree: PrefixTree | None, at: torch.Tensor | None, window_sizes: list[int], max_len: int) -> Span:
    """The positions and masks of a forward over idx (B, T); refuses a sequence past the max_len positions
    the model's rotary table holds."""
    T = idx.size(1)
    T0 = kv_cache.pos if kv_cache is not None else 0
    span = tree.span if tree is not None else T0 + T
    if span > max_len:
        raise ValueError(f"sequence of {span} tokens is longer than the model's {max_len} rotary positions")
    single = at is not None and at.dim() == 1
    at = at[:, None] if single else at
    positions = tree.positions if tree is not None else row_positions(key_mask, T0, T)  # left padding: from 0
    return Span(T0, positions, at, single, layer_masks(window_sizes, T, T0, key_mask, tree, at, idx.device))
