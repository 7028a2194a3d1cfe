"""A nanochat-compatible GPT that loads nanochat state dicts.

Two generations of nanochat checkpoints are told apart by their state-dict keys:
- "classic" (Oct 2025, what the density fork trained): rotary, QK norm, relu^2 MLP, functional
  RMSNorm, untied wte/lm_head, GQA, logit softcap 15.
- "modern" (2026): the above plus per-layer `resid_lambdas`/`x0_lambdas`, ResFormer value
  embeddings on alternating layers with a per-head gate (`ve_gate`), sliding-window attention
  (`window_pattern`) and a vocabulary padded to a multiple of 64.
Parameter names match nanochat's, so its checkpoints load with strict=True and ours load in nanochat.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

VE_GATE_CHANNELS = 32  # nanochat's value-embedding gate reads the first 32 channels
SOFTCAP = 15.0


@dataclass
class GPTConfig:
    sequence_len: int = 1024
    vocab_size: int = 32768
    n_layer: int = 12
    n_head: int = 6
    n_kv_head: int = 6
    n_embd: int = 768
    window_pattern: str = "L"  # "L" full context, "S" half context, tiled over layers; last layer L
    modern: bool = False  # resid/x0 lambdas + value embeddings (2026 nanochat)
    padded_vocab_size: int = 0  # rows of wte/lm_head; 0 -> vocab_size

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def nanochat_dict(self) -> dict:
        """The `model_config` nanochat's own GPTConfig(**...) accepts (our extra fields left out)."""
        keys = ["sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd"]
        d = {k: v for k, v in asdict(self).items() if k in keys}
        if self.modern:
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


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """SDPA over (B, H, T, D) with GQA; mask None: causal when T > 1, all keys for a single query."""
    gqa = q.size(1) != k.size(1)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.size(2) > 1, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.c_q = nn.Linear(config.n_embd, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        use_gate = config.modern and has_ve(layer_idx, config.n_layer)
        self.ve_gate = nn.Linear(VE_GATE_CHANNELS, self.n_kv_head, bias=False) if use_gate else None

    def forward(self, x, ve, cos_sin, attn_mask, kv_cache=None, layer_idx=0):
        B, T, _ = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        if ve is not None:
            gate = 2 * torch.sigmoid(self.ve_gate(x[..., :VE_GATE_CHANNELS]))  # (B, T, n_kv_head) in (0, 2)
            v = v + gate.unsqueeze(-1) * ve.view(B, T, self.n_kv_head, self.head_dim)
        cos, sin = cos_sin
        q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
        q, k = norm(q), norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if kv_cache is not None:
            k, v = kv_cache.insert(layer_idx, k, v)
        y = attend(q, k, v, attn_mask)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


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
    cached key (T == 1), with no padding and a window that covers it all (see `attend`)."""
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


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn = CausalSelfAttention(config, layer_idx)
        self.mlp = MLP(config)

    def forward(self, x, ve, cos_sin, attn_mask, kv_cache=None):
        x = x + self.attn(norm(x), ve, cos_sin, attn_mask, kv_cache, self.layer_idx)
        return x + self.mlp(norm(x))


class KVCache:
    """Keys/values of every layer for a batch being decoded: (n_layer, B, n_kv_head, max_len, head_dim)."""

    def __init__(self, n_layer: int, batch: int, n_kv_head: int, head_dim: int, max_len: int, device, dtype):
        shape = (n_layer, batch, n_kv_head, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = 0  # tokens already cached

    def insert(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        end = self.pos + k.size(2)
        if end > self.k.size(3):
            raise ValueError(f"KV cache of {self.k.size(3)} positions is full")
        self.k[layer, :, :, self.pos:end] = k
        self.v[layer, :, :, self.pos:end] = v
        if layer == self.k.size(0) - 1:
            self.pos = end
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def repeat_interleave(self, n: int) -> None:
        """Each row becomes n rows: a prompt prefilled once serves its n samples."""
        self.k = self.k.repeat_interleave(n, dim=1)
        self.v = self.v.repeat_interleave(n, dim=1)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        vocab_rows = config.padded_vocab_size or config.vocab_size
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(vocab_rows, config.n_embd),
            "h": nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
        })
        self.lm_head = nn.Linear(config.n_embd, vocab_rows, bias=False)
        if config.modern:
            kv_dim = config.n_kv_head * (config.n_embd // config.n_head)
            self.resid_lambdas = nn.Parameter(torch.ones(config.n_layer))
            self.x0_lambdas = nn.Parameter(torch.zeros(config.n_layer))
            self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(vocab_rows, kv_dim)
                                               for i in range(config.n_layer) if has_ve(i, config.n_layer)})
        self.window_sizes = self._window_sizes(config)
        cos, sin = self._rotary(config.sequence_len * 10, config.n_embd // config.n_head)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @staticmethod
    def _window_sizes(config: GPTConfig) -> list[int]:
        pattern = config.window_pattern.upper()
        if not pattern or any(c not in "SL" for c in pattern):
            raise ValueError(f"window_pattern must use only S and L, got {config.window_pattern!r}")
        sizes = [config.sequence_len // 2 if pattern[i % len(pattern)] == "S" else config.sequence_len
                 for i in range(config.n_layer)]
        sizes[-1] = config.sequence_len
        return sizes

    @staticmethod
    def _rotary(seq_len: int, head_dim: int, base: float = 10000.0):
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
        # nanochat keeps the tables in bf16; matching it keeps logits identical to nanochat's.
        return freqs.cos().bfloat16()[None, :, None, :], freqs.sin().bfloat16()[None, :, None, :]

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """nanochat-style init (used for tiny test/demo models; real ones come from checkpoints)."""
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        n = self.config.n_embd
        s = 3 ** 0.5 * n ** -0.5
        for p in [self.transformer.wte.weight] + ([e.weight for e in self.value_embeds.values()]
                                                   if self.config.modern else []):
            p.normal_(0.0, 1.0, generator=g)
        self.lm_head.weight.normal_(0.0, 0.02, generator=g)
        for block in self.transformer.h:
            for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.attn.c_proj,
                        block.mlp.c_fc, block.mlp.c_proj):
                lin.weight.uniform_(-s, s, generator=g)
            if block.attn.ve_gate is not None:
                block.attn.ve_gate.weight.uniform_(-s, s, generator=g)
        if self.config.modern:
            self.resid_lambdas.fill_(1.0)
            self.x0_lambdas.fill_(0.1)

    def hidden_states(self, idx: torch.Tensor, key_mask: torch.Tensor | None = None,
                      kv_cache: KVCache | None = None) -> torch.Tensor:
        """Final-normed hidden states (B, T, n_embd) of `idx`, which continues the cache if one is given.
        key_mask (B, cached + T) marks real tokens (False: left padding). Right padding needs no mask."""
        B, T = idx.shape
        T0 = kv_cache.pos if kv_cache is not None else 0
        if T0 + T > self.cos.size(1):
            raise ValueError(f"sequence of {T0 + T} tokens is longer than the rotary table ({self.cos.size(1)})")
        cos_sin = self.cos[:, T0:T0 + T], self.sin[:, T0:T0 + T]
        masks = attn_masks(self.window_sizes, T, T0, key_mask, idx.device)
        x = norm(self.transformer.wte(idx))
        x0 = x
        for i, block in enumerate(self.transformer.h):
            ve = None
            if self.config.modern:
                x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
                ve = self.value_embeds[str(i)](idx) if str(i) in self.value_embeds else None
            x = block(x, ve, cos_sin, masks[i], kv_cache)
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
        return SOFTCAP * torch.tanh(logits / SOFTCAP)

    def forward(self, idx: torch.Tensor, key_mask: torch.Tensor | None = None,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        return self.logits(self.hidden_states(idx, key_mask, kv_cache))


def config_from_state_dict(state: dict[str, torch.Tensor], meta_config: dict) -> GPTConfig:
    """The checkpoint's `model_config`, completed with what only the weights say (generation, padding)."""
    cfg = GPTConfig.from_dict(meta_config)
    cfg.modern = "resid_lambdas" in state
    cfg.padded_vocab_size = state["transformer.wte.weight"].shape[0]
    if "window_pattern" not in meta_config:
        cfg.window_pattern = "SSSL" if cfg.modern else "L"  # each generation's default
    return cfg
