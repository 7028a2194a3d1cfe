"""A nanochat-compatible GPT that loads every checkpoint layout nanochat has written since Oct 2025
and computes exactly what that nanochat commit computes.

nanochat has no version field: what a checkpoint needs is told apart by its state-dict keys and
shapes (and, for the one week the keys cannot tell, by the meta or the user). `VINTAGES` below is the
one place that says what each vintage changed; the model reads its behaviour from it. Parameter
names match nanochat's, so its checkpoints load with strict=True and ours load in nanochat.
Verified against nanochat's own forward pass at each vintage (tests/fixtures/nanochat-golden).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat_ext.errors import InputError

NO_WINDOW = 1 << 30  # a window no sequence reaches: full causal attention


@dataclass(frozen=True)
class Vintage:
    """What one era of nanochat's forward pass computes. Commits are karpathy/nanochat's."""
    name: str
    written_by: str  # the commits whose checkpoints have this layout and forward pass
    pads_vocab: bool = True  # wte/lm_head rows padded to a multiple of 64, logits sliced back to vocab_size
    lambdas: bool = False  # per-layer resid_lambdas / x0_lambdas
    windows: bool = False  # sliding-window attention from `window_pattern`
    short_window_div: int = 2  # S = sequence_len // div (rounded up to 128 when round128)
    round128: bool = False
    value_embeds: bool = False  # ResFormer value embeddings on alternating layers, with a per-head gate
    ve_gate_channels: int = 32
    ve_gate_scale: float = 2.0  # gate = scale * sigmoid(ve_gate(x[..., :channels]))
    rotary_base: float = 10000.0
    rotary_bf16: bool = True  # table kept in bf16 even on CPU (later: the compute dtype, fp32 on CPU)
    qk_scale: float = 1.0  # q and k multiplied after the QK rms-norm
    softcap: float = 15.0
    smear: bool = False  # x[t] += smear_lambda * sigmoid(smear_gate(x[t, :24])) * x[t-1]
    backout: bool = False  # x -= backout_lambda * (residual after block n_layer // 2) before the final norm

    def short_window(self, sequence_len: int) -> int:
        w = sequence_len // self.short_window_div
        return -(-w // 128) * 128 if self.round128 else w


_OCT = Vintage("oct2025", "a088b7a..f1bf69d (2025-10-21..2025-12-09; the density fork)", pads_vocab=False)
_JAN = Vintage("jan2026", "fbc1484..e85db6b (2026-01-11..2026-01-16)", lambdas=True, windows=True)
_FEB = Vintage("feb2026", "e85db6b..aba30cb (2026-01-16..2026-03-02)", lambdas=True, windows=True,
               value_embeds=True)
_MAR_B = Vintage("mar2026b", "6ed7d1d..a825e63 (2026-03-09..2026-03-14)", lambdas=True, windows=True,
                 short_window_div=3, round128=True, value_embeds=True, ve_gate_channels=12, ve_gate_scale=3.0,
                 rotary_base=100000.0, rotary_bf16=False, qk_scale=1.15)
VINTAGES: dict[str, Vintage] = {v.name: v for v in [
    _OCT,
    # oct2025's forward pass with padded vocabulary rows.
    Vintage("dec2025", "f1bf69d..fbc1484 (2025-12-09..2026-01-11)"),
    _JAN,
    _FEB,
    # Softcap 20; from 1076f97 dtypes follow COMPUTE_DTYPE (fp32 on CPU, the rotary table included).
    Vintage("mar2026a", "aba30cb..6ed7d1d (2026-03-02..2026-03-09)", lambdas=True, windows=True,
            value_embeds=True, rotary_bf16=False, softcap=20.0),
    _MAR_B,
    Vintage("current", "a825e63..today (2026-03-14..)", lambdas=True, windows=True, short_window_div=4,
            round128=True, value_embeds=True, ve_gate_channels=12, ve_gate_scale=3.0, rotary_base=100000.0,
            rotary_bf16=False, qk_scale=1.2, smear=True, backout=True),
]}
SMEAR_CHANNELS = 24
VINTAGE_FLAG = "--nanochat_vintage"


@dataclass
class GPTConfig:
    sequence_len: int = 1024
    vocab_size: int = 32768
    n_layer: int = 12
    n_head: int = 6
    n_kv_head: int = 6
    n_embd: int = 768
    window_pattern: str = "L"  # tiled over layers, last layer L; nanochat's loader patches a missing one to "L"
    vintage: str = "current"
    padded_vocab_size: int = 0  # rows of wte/lm_head; 0 -> vocab_size

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @property
    def v(self) -> Vintage:
        return VINTAGES[self.vintage]

    def nanochat_dict(self) -> dict:
        """A `model_config` that vintage's GPTConfig(**...) accepts (for models we create ourselves;
        a loaded checkpoint's own model_config is saved back verbatim)."""
        d = {"sequence_len": self.sequence_len, "vocab_size": self.vocab_size, "n_layer": self.n_layer,
             "n_head": self.n_head, "n_kv_head": self.n_kv_head, "n_embd": self.n_embd}
        if self.v.windows:
            d["window_pattern"] = self.window_pattern
        return d


def norm(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.size(-1),))


def has_ve(layer_idx: int, n_layer: int) -> bool:
    """Value embeddings on alternating layers, the last one always included (nanochat's rule)."""
    return layer_idx % 2 == (n_layer - 1) % 2


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    d = x.shape[3] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos], 3).to(x.dtype)


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


def gate_input(x: torch.Tensor, channels: int) -> torch.Tensor:
    """x's first `channels` features, contiguous, for a gate's linear layer. On a strided 3-D input torch's
    matmul runs one folded mm when the weight requires grad and a bmm when it does not, which round
    differently: GRPO's frozen reference would then not give its policy's log-probs at equal weights."""
    return x[..., :channels].contiguous()


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
    def from_lengths(cls, lengths: torch.Tensor, device: torch.device | str = "cpu") -> "PrefixTree":
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


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | TreeAttention | None) -> torch.Tensor:
    """SDPA over (B, H, T, D) with GQA; mask None: causal when T > 1, all keys for a single query;
    a TreeAttention: prefix-tree rows (see PrefixTree)."""
    if isinstance(mask, TreeAttention):
        return mask(q, k, v)
    gqa = q.size(1) != k.size(1)
    if mask is None and q.size(2) > 1:  # a branch, not is_causal=T > 1: compiled, T is a symbol, not a bool
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.v = config.v
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.c_q = nn.Linear(config.n_embd, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        use_gate = self.v.value_embeds and has_ve(layer_idx, config.n_layer)
        self.ve_gate = nn.Linear(self.v.ve_gate_channels, self.n_kv_head, bias=False) if use_gate else None

    def forward(self, x, ve, cos_sin, attn_mask, kv_cache=None, layer_idx=0, at=None):
        """at (B, K): queries only at those positions (keys and values at all): (B, K, C) out."""
        B, T, _ = x.shape
        xq = x if at is None else rows_at(x, at)
        q = self.c_q(xq).view(B, xq.size(1), self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        if ve is not None:
            gate = self.v.ve_gate_scale * torch.sigmoid(self.ve_gate(gate_input(x, self.v.ve_gate_channels)))
            v = v + gate.unsqueeze(-1) * ve.view(B, T, self.n_kv_head, self.head_dim)
        cos, sin = cos_sin
        cos_q, sin_q = (cos, sin) if at is None else (rows_at(cos, at), rows_at(sin, at))
        q, k = apply_rotary_emb(q, cos_q, sin_q), apply_rotary_emb(k, cos, sin)
        q, k = norm(q), norm(k)
        if self.v.qk_scale != 1.0:
            q, k = q * self.v.qk_scale, k * self.v.qk_scale
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if kv_cache is not None:
            k, v = kv_cache.insert(layer_idx, k, v)
        y = attend(q, k, v, attn_mask)
        return self.c_proj(y.transpose(1, 2).reshape(B, q.size(2), -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


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


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn = CausalSelfAttention(config, layer_idx)
        self.mlp = MLP(config)

    def forward(self, x, ve, cos_sin, attn_mask, kv_cache=None, at=None, real_tokens=None):
        """at (B, K): the block's output only at those positions, (B, K, C). real_tokens: the positions
        of padded rows that are not padding, for the MLP (add_mlp); unused with `at`, which picks rows."""
        h = self.attn(norm(x), ve, cos_sin, attn_mask, kv_cache, self.layer_idx, at)
        x = (x if at is None else rows_at(x, at)) + h
        return add_mlp(x, lambda t: self.mlp(norm(t)), real_tokens if at is None else None)


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
        self.prev_embedding: torch.Tensor | None = None  # (B, 1, n_embd), smear vintages only

    def insert(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Append k, v after the cached positions and return the keys and values so far; with `slot`
        set (static decoding), write the one new position at that slot and return the whole cache."""
        if self.slot is not None:
            self.k[layer].index_copy_(2, self.slot, k)
            self.v[layer].index_copy_(2, self.slot, v)
            return self.k[layer], self.v[layer]
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


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.vintage not in VINTAGES:
            raise ValueError(f"unknown nanochat vintage {config.vintage!r}; known: {', '.join(VINTAGES)}")
        self.config = config
        v = config.v
        vocab_rows = config.padded_vocab_size or config.vocab_size
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(vocab_rows, config.n_embd),
            "h": nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
        })
        self.lm_head = nn.Linear(config.n_embd, vocab_rows, bias=False)
        if v.lambdas:
            self.resid_lambdas = nn.Parameter(torch.ones(config.n_layer))
            self.x0_lambdas = nn.Parameter(torch.zeros(config.n_layer))
        if v.smear:
            self.smear_gate = nn.Linear(SMEAR_CHANNELS, 1, bias=False)
            self.smear_lambda = nn.Parameter(torch.zeros(1))
        if v.backout:
            self.backout_lambda = nn.Parameter(0.2 * torch.ones(1))
        if v.value_embeds:
            kv_dim = config.n_kv_head * (config.n_embd // config.n_head)
            self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(vocab_rows, kv_dim)
                                               for i in range(config.n_layer) if has_ve(i, config.n_layer)})
        self.window_sizes = self._window_sizes(config)
        # (10 * sequence_len, 2, head_dim / 2): cos and sin side by side, so a batch of per-row positions
        # takes one gather; kept in the dtype this vintage uses on CPU (see _rotary_dtype).
        rotary = self._rotary(config.sequence_len * 10, config.n_embd // config.n_head, v.rotary_base)
        self.register_buffer("rotary", rotary.to(torch.bfloat16 if v.rotary_bf16 else torch.float32),
                             persistent=False)

    @staticmethod
    def _window_sizes(config: GPTConfig) -> list[int]:
        if not config.v.windows:
            return [NO_WINDOW] * config.n_layer
        pattern = config.window_pattern.upper()
        if not pattern or any(c not in "SL" for c in pattern):
            raise ValueError(f"window_pattern must use only S and L, got {config.window_pattern!r}")
        short = config.v.short_window(config.sequence_len)
        sizes = [short if pattern[i % len(pattern)] == "S" else config.sequence_len for i in range(config.n_layer)]
        sizes[-1] = config.sequence_len
        return sizes

    @staticmethod
    def _rotary(seq_len: int, head_dim: int, base: float) -> torch.Tensor:
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
        return torch.stack([freqs.cos(), freqs.sin()], dim=1)  # computed in fp32, as nanochat does

    def _rotary_dtype(self, device: torch.device) -> torch.dtype:
        # Oct 2025 .. Feb 2026 keep the table in bf16 everywhere; later nanochat uses its compute dtype
        # (bf16 on CUDA, fp32 on CPU). Matching it is worth ~1e-2 in the logits.
        return torch.bfloat16 if self.config.v.rotary_bf16 or device.type == "cuda" else torch.float32

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Random init for tiny test/demo models (real ones come from checkpoints). Every parameter,
        gates and scalars included, gets a non-trivial value, so each one matters to the output."""
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        n = self.config.n_embd
        s = 3 ** 0.5 * n ** -0.5
        embeddings = [self.transformer.wte.weight]
        if self.config.v.value_embeds:
            embeddings += [e.weight for e in self.value_embeds.values()]
        for p in embeddings:
            p.normal_(0.0, 1.0, generator=g)
        self.lm_head.weight.normal_(0.0, 0.02, generator=g)
        for block in self.transformer.h:
            for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.attn.c_proj,
                        block.mlp.c_fc, block.mlp.c_proj):
                lin.weight.uniform_(-s, s, generator=g)
            if block.attn.ve_gate is not None:
                block.attn.ve_gate.weight.uniform_(-s, s, generator=g)
        if self.config.v.lambdas:
            self.resid_lambdas.fill_(1.0)
            self.x0_lambdas.fill_(0.1)
        if self.config.v.smear:
            self.smear_gate.weight.uniform_(-s, s, generator=g)
            self.smear_lambda.fill_(0.5)
        if self.config.v.backout:
            self.backout_lambda.fill_(0.2)

    def _smear(self, x: torch.Tensor, positions: torch.Tensor | None, kv_cache: KVCache | None,
               prev: torch.Tensor | None = None) -> torch.Tensor:
        """Mix the previous token's normed embedding into each token that has one (position >= 1).
        prev (B, T): each token's predecessor index when it is not the token before (a PrefixTree)."""
        cached = kv_cache.swap_embedding(x[:, -1:]) if kv_cache is not None else None
        if x.size(1) > 1:
            gate = self.smear_lambda * torch.sigmoid(self.smear_gate(gate_input(x[:, 1:], SMEAR_CHANNELS)))
            if positions is not None:  # a left-padded row's first real token has no predecessor
                gate = gate * (positions[:, 1:, None] > 0)
            before = x[:, :-1] if prev is None else x.gather(1, prev[:, 1:, None].expand(-1, -1, x.size(-1)))
            return torch.cat([x[:, :1], x[:, 1:] + gate * before], dim=1)
        if cached is not None:  # one decoded token: its predecessor's embedding is in the cache
            return x + self.smear_lambda * torch.sigmoid(self.smear_gate(gate_input(x, SMEAR_CHANNELS))) * cached
        return x

    def hidden_states(self, idx: torch.Tensor, key_mask: torch.Tensor | None = None,
                      kv_cache: KVCache | None = None, at: torch.Tensor | None = None,
                      tree: PrefixTree | None = None) -> torch.Tensor:
        """Final-normed hidden states (B, T, n_embd) of `idx`, which continues the cache if one is given.
        key_mask (B, cached + T) marks real tokens (False: left padding); each row then counts its
        positions from its own first real token. Right padding needs no mask.
        tree: rows that are a shared prefix and branches (see PrefixTree), without cache.
        at (B,) or (B, K), without cache: only row b's states at positions at[b], (B, n_embd) or
        (B, K, n_embd); the last block then runs its queries and MLP there alone (a reward model reads
        nothing else)."""
        B, T = idx.shape
        v = self.config.v
        T0 = kv_cache.pos if kv_cache is not None else 0
        span = tree.span if tree is not None else T0 + T
        if span > self.rotary.size(0):
            raise ValueError(f"sequence of {span} tokens is longer than the rotary table ({self.rotary.size(0)})")
        single = at is not None and at.dim() == 1
        at = at[:, None] if single else at
        positions = tree.positions if tree is not None else row_positions(key_mask, T0, T)
        table = rotary_slice(self.rotary, positions, T0, T).to(self._rotary_dtype(idx.device))  # no-op on CPU
        cos_sin = table[:, :, None, 0], table[:, :, None, 1]  # (1 or B, T, 1, head_dim / 2)
        masks = layer_masks(self.window_sizes, T, T0, key_mask, tree, at, idx.device)
        x = norm(self.transformer.wte(idx))
        if v.smear:
            x = self._smear(x, positions, kv_cache, tree.prev if tree is not None else None)
        x = self._trunk(idx, x, cos_sin, masks, kv_cache, at, tree.real_tokens if tree is not None else None)
        return x[:, 0] if single else x

    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor,
                    kv_cache: KVCache) -> torch.Tensor:
        """One token per row (B,) against a static cache (kv_cache.slot set): static shapes throughout,
        so torch.compile captures it whole. positions (B,): each row's position for the token;
        key_valid (B, L): the cache slots each row may see, the token's own slot included. Logits (B, V)."""
        table = self.rotary[positions[:, None]].to(self._rotary_dtype(tokens.device))  # (B, 1, 2, head_dim / 2)
        cos_sin = table[:, :, None, 0], table[:, :, None, 1]
        masks = static_masks(key_valid, kv_cache.slot, self.window_sizes)
        x = norm(self.transformer.wte(tokens[:, None]))
        if self.config.v.smear:
            x = self._smear(x, None, kv_cache)
        return self.logits(self._trunk(tokens[:, None], x, cos_sin, masks, kv_cache, None)[:, -1])

    def _trunk(self, idx, x, cos_sin, masks, kv_cache, at, real_tokens=None):
        """The blocks (with the vintage's lambdas, value embeddings and backout) and the final norm."""
        v = self.config.v
        x0, x_backout = x, None
        last = self.config.n_layer - 1
        for i, block in enumerate(self.transformer.h):
            ve = None
            if v.lambdas:
                x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            if v.value_embeds and str(i) in self.value_embeds:
                ve = self.value_embeds[str(i)](idx)
            x = block(x, ve, cos_sin, masks[i], kv_cache=kv_cache, at=at if i == last else None,
                      real_tokens=real_tokens)
            if v.backout and i == self.config.n_layer // 2:
                x_backout = x
        if x_backout is not None:  # taken before the last block unless there is only one
            picked = at is not None and self.config.n_layer // 2 != last
            x = x - self.backout_lambda * (rows_at(x_backout, at) if picked else x_backout)
        return norm(x)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.transformer.h

    @property
    def max_seq_len(self) -> int:
        return self.config.sequence_len

    def new_kv_cache(self, batch: int, max_len: int) -> KVCache:
        p = self.transformer.wte.weight
        c = self.config
        return KVCache(c.n_layer, batch, c.n_kv_head, c.n_embd // c.n_head, max_len, p.device, p.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)[..., :self.config.vocab_size].float()
        cap = self.config.v.softcap
        return cap * torch.tanh(logits / cap)

    def forward(self, idx: torch.Tensor, key_mask: torch.Tensor | None = None,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        return self.logits(self.hidden_states(idx, key_mask, kv_cache))


# ---- telling vintages apart ---------------------------------------------------------------------
def layout_candidates(state: dict[str, torch.Tensor], vocab_size: int) -> list[str]:
    """The vintages whose state-dict layout this is (all but the softcap-20 week are unique). A vocabulary
    that is already a multiple of 64 leaves oct2025 and dec2025 identical: either computes the same."""
    gates = [v for k, v in state.items() if k.endswith("attn.ve_gate.weight")]
    if "smear_gate.weight" in state or "backout_lambda" in state:
        return ["current"]
    if gates and gates[0].shape[-1] == 12:
        return ["mar2026b"]
    if any(k.startswith("value_embeds.") for k in state):
        return ["feb2026", "mar2026a"]
    if "resid_lambdas" in state:
        return ["jan2026"]
    wte = state.get("transformer.wte.weight")
    return ["dec2025"] if wte is not None and wte.shape[0] != vocab_size else ["oct2025"]


def vintage_from_meta(meta: dict) -> str | None:
    """What a meta says about the vintage: ours records it; nanochat's says it only indirectly.
    chat_sft's `--dtype`/`--dry-run` were removed on 2026-02-16 and base_train's `--fp8` added on
    2026-02-03, both before the softcap-20 week began (aba30cb, 2026-03-02)."""
    if meta.get("nanochat_vintage"):
        return meta["nanochat_vintage"]
    user_config = meta.get("user_config") or {}
    if "dtype" in user_config or "dry_run" in user_config:  # chat_sft before 2026-02-16
        return "feb2026"
    if "depth" in user_config and "fp8" not in user_config:  # base_train before 2026-02-03
        return "feb2026"
    return None


def pick_vintage(state: dict[str, torch.Tensor], meta: dict, requested: str | None, path: str) -> str:
    """The vintage to run a checkpoint as: the user's choice, else the only one its layout fits, else
    what the meta says; never a guess."""
    vocab_size = int(meta["model_config"].get("vocab_size", 0))
    candidates = layout_candidates(state, vocab_size)
    if requested is not None:
        if requested not in VINTAGES:
            raise InputError(f"{VINTAGE_FLAG} {requested!r} is not a nanochat vintage; known: {', '.join(VINTAGES)}")
        return requested  # the strict load below refuses it if the layout does not fit
    if len(candidates) == 1:
        return candidates[0]
    said = vintage_from_meta(meta)
    if said in candidates:
        return said
    described = "; ".join(f"{c} (nanochat {VINTAGES[c].written_by}, logit softcap {VINTAGES[c].softcap:g})"
                          for c in candidates)
    raise InputError(f"cannot tell which nanochat wrote this checkpoint: its layout fits {described}, and its "
                     f"meta does not say. Pass {VINTAGE_FLAG} " + " or ".join(candidates) +
                     " (the nanochat commit you trained with decides)", path=path)


def _shorten(keys: list[str], limit: int = 12) -> str:
    """Keys with their layer numbers folded: 'transformer.h.{0,1}.attn.ve_gate.weight'."""
    groups: dict[str, list[str]] = {}
    for k in keys:
        m = re.match(r"^(.*?\.h\.)(\d+)(\..*)$", k) or re.match(r"^(value_embeds\.)(\d+)(\..*)$", k)
        if m:
            groups.setdefault(m.group(1) + "{}" + m.group(3), []).append(m.group(2))
        else:
            groups.setdefault(k, [])
    out = [g.format("{" + ",".join(sorted(ix, key=int)) + "}") if ix else g for g, ix in groups.items()]
    more = f" ... and {len(out) - limit} more" if len(out) > limit else ""
    return ", ".join(out[:limit]) + more if out else "none"


def check_layout(model: GPT, state: dict[str, torch.Tensor], path: str) -> None:
    """Refuse a state dict that does not fit the model, naming every missing and unexpected key and
    every shape that differs (layer numbers folded), and the vintages we know."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    shapes = [f"{k} {tuple(state[k].shape)} (expected {expected[k]})" for k in expected
              if k in state and tuple(state[k].shape) != expected[k]]
    if missing or unexpected or shapes:
        raise InputError(
            f"state dict does not fit a nanochat GPT of vintage {model.config.vintage}: "
            f"missing [{_shorten(missing)}]; unexpected [{_shorten(unexpected)}]; shapes differ "
            f"[{', '.join(shapes[:8]) or 'none'}]. Known vintages: " +
            ", ".join(f"{v.name} ({v.written_by})" for v in VINTAGES.values()), path=path)


def gpt_from_checkpoint(state: dict[str, torch.Tensor], meta: dict, requested_vintage: str | None,
                        path: str) -> GPT:
    """Build and load the GPT a nanochat checkpoint describes, exactly as its nanochat computes it."""
    vintage = pick_vintage(state, meta, requested_vintage, path)
    model_config = meta["model_config"]
    cfg = GPTConfig.from_dict(model_config)
    cfg.vintage = vintage
    cfg.window_pattern = model_config.get("window_pattern", "L")  # nanochat's loader patches a missing one so
    wte = state.get("transformer.wte.weight")  # rows as saved: the padding rule changed over time
    cfg.padded_vocab_size = wte.shape[0] if wte is not None else cfg.vocab_size
    try:
        model = GPT(cfg)
    except (ValueError, TypeError) as e:
        raise InputError(f"model_config does not describe a nanochat GPT: {e}", path=path, field="model_config")
    check_layout(model, state, path)
    model.load_state_dict(state, strict=True)
    return model


def padded(vocab_size: int, multiple: int = 64) -> int:
    return math.ceil(vocab_size / multiple) * multiple
