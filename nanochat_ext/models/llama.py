"""A lean native implementation of Hugging Face Llama-family causal LMs (llama, mistral, qwen2 with
default RoPE and SiLU), loaded from a local HF dir and saved back as one.

Why not run transformers' own module: on small models its per-call Python overhead dominates (about
6 ms per forward of a 4-layer model on CPU), which decides token-by-token sampling speed. Here q/k/v
and gate/up are fused into single matmuls, RMSNorm is one fused op, and decoding uses the same
KV cache and masks as the nanochat GPT. Numerics match transformers' forward (tested); architectures
outside this family keep the transformers path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat_ext.models.attention import (
    KVCache,
    PrefixTree,
    add_mlp,
    attend,
    forward_span,
    rotary_slice,
    rows_at,
    static_masks,
)

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    n_layer: int
    n_head: int
    n_kv_head: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    sliding_window: int | None


def config_from_hf(cfg) -> LlamaConfig | None:
    """Our config for a transformers config, or None when the architecture is not one we run natively."""
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "other"
    if cfg.model_type not in SUPPORTED_TYPES or rope_type != "default" or getattr(cfg, "hidden_act", "silu") != "silu":
        return None
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
    return LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, n_layer=cfg.num_hidden_layers,
        n_head=cfg.num_attention_heads, n_kv_head=cfg.num_key_value_heads or cfg.num_attention_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        intermediate_size=cfg.intermediate_size, rms_norm_eps=cfg.rms_norm_eps, rope_theta=float(theta),
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=bool(cfg.tie_word_embeddings),
        sliding_window=window)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig, qkv_bias: bool, o_bias: bool):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = c.n_head, c.n_kv_head, c.head_dim
        self.qkv = nn.Linear(c.hidden_size, (c.n_head + 2 * c.n_kv_head) * c.head_dim, bias=qkv_bias)
        self.o = nn.Linear(c.n_head * c.head_dim, c.hidden_size, bias=o_bias)

    def forward(self, x, cos_sin, mask, kv_cache, layer_idx, at=None):
        """at (B, K): queries only at those positions (keys and values at all): (B, K, hidden) out."""
        B, T, _ = x.shape
        qk, v = self.qkv(x).split([(self.n_head + self.n_kv_head) * self.head_dim, self.n_kv_head * self.head_dim],
                                  dim=-1)
        # RoPE once over the fused q|k heads: fewer ops per decoded token.
        qk = qk.view(B, T, self.n_head + self.n_kv_head, self.head_dim).transpose(1, 2)
        cos, sin = cos_sin
        qk = qk * cos + rotate_half(qk) * sin
        # Contiguous: under inductor with symbolic lengths, the backward graph fixed the slices' strides at the first
        # length's and failed its stride assert at the next (test_compiled_llama_trains_at_new_lengths_as_eager).
        q, k = (t.contiguous() for t in qk.split([self.n_head, self.n_kv_head], dim=1))
        if at is not None:
            q = rows_at(q.transpose(1, 2), at).transpose(1, 2)  # (B, n_head, K, head_dim)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if kv_cache is not None:
            k, v = kv_cache.insert(layer_idx, k, v)
        return self.o(attend(q, k, v, mask, cached=kv_cache is not None).transpose(1, 2).reshape(B, q.size(2), -1))


class Block(nn.Module):
    def __init__(self, c: LlamaConfig, layer_idx: int, qkv_bias: bool, o_bias: bool, mlp_bias: bool):
        super().__init__()
        self.layer_idx, self.eps = layer_idx, c.rms_norm_eps
        self.attn_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.attn = Attention(c, qkv_bias, o_bias)
        self.mlp_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.gate_up = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=mlp_bias)
        self.down = nn.Linear(c.intermediate_size, c.hidden_size, bias=mlp_bias)

    def forward(self, x, cos_sin, mask, kv_cache=None, at=None, real_tokens=None):
        """at (B, K): the block's output only at those positions, (B, K, hidden). real_tokens: as GPT's Block."""
        n = x.size(-1)
        h = self.attn(F.rms_norm(x, (n,), self.attn_norm, self.eps), cos_sin, mask, kv_cache, self.layer_idx, at)
        x = (x if at is None else rows_at(x, at)) + h
        return add_mlp(x, self.mlp, real_tokens if at is None else None)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(F.rms_norm(x, (x.size(-1),), self.mlp_norm, self.eps)).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Llama(nn.Module):
    def __init__(self, c: LlamaConfig, qkv_bias: bool = False, o_bias: bool = False, mlp_bias: bool = False):
        super().__init__()
        self.config = c
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList([Block(c, i, qkv_bias, o_bias, mlp_bias) for i in range(c.n_layer)])
        self.norm = nn.Parameter(torch.ones(c.hidden_size))
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        window = c.sliding_window or (1 << 30)
        self.window_sizes = [window] * c.n_layer
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        freqs = torch.outer(torch.arange(c.max_position_embeddings, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)  # (max_position_embeddings, head_dim)
        self.register_buffer("sin", emb.sin(), persistent=False)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.layers

    @property
    def max_seq_len(self) -> int:
        return self.config.max_position_embeddings

    def new_kv_cache(self, batch: int, max_len: int) -> KVCache:
        p, c = self.embed.weight, self.config
        return KVCache(c.n_layer, batch, c.n_kv_head, c.head_dim, max_len, p.device, p.dtype)

    def hidden_states(self, idx: torch.Tensor, key_mask: torch.Tensor | None = None,
                      kv_cache: KVCache | None = None, at: torch.Tensor | None = None,
                      tree: PrefixTree | None = None) -> torch.Tensor:
        """Final-normed hidden states (B, T, hidden); same contract as GPT.hidden_states, `at` and
        `tree` included."""
        s = forward_span(idx, key_mask, kv_cache, tree, at, self.window_sizes, self.cos.size(0))
        cos_sin = tuple(rotary_slice(t, s.positions, s.T0, idx.size(1))[:, None] for t in (self.cos, self.sin))
        x = self.embed(idx)
        last, real_tokens = len(self.layers) - 1, tree.real_tokens if tree is not None else None
        for i, (block, mask) in enumerate(zip(self.layers, s.masks)):
            x = block(x, cos_sin, mask, kv_cache=kv_cache, at=s.at if i == last else None, real_tokens=real_tokens)
        x = F.rms_norm(x, (x.size(-1),), self.norm, self.config.rms_norm_eps)
        return x[:, 0] if s.single else x

    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor,
                    kv_cache: KVCache) -> torch.Tensor:
        """One token per row against a static cache; same contract as GPT.decode_step."""
        cos_sin = self.cos[positions[:, None]][:, None], self.sin[positions[:, None]][:, None]  # (B, 1, 1, hd)
        masks = static_masks(key_valid, kv_cache.slot, self.window_sizes)
        x = self.embed(tokens[:, None])
        for block, mask in zip(self.layers, masks):
            x = block(x, cos_sin, mask, kv_cache=kv_cache)
        return self.logits(F.rms_norm(x, (x.size(-1),), self.norm, self.config.rms_norm_eps)[:, -1])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:  # (a decoding copy gives a tied model one too: engine/packed.py)
            return self.lm_head(hidden).float()
        return F.linear(hidden, self.embed.weight).float()

    def forward(self, idx: torch.Tensor, key_mask: torch.Tensor | None = None,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        return self.logits(self.hidden_states(idx, key_mask, kv_cache))

    # ---- Hugging Face names <-> ours --------------------------------------------------------------
    @classmethod
    def from_hf_state_dict(cls, c: LlamaConfig, sd: dict[str, torch.Tensor]) -> Llama:
        L = "model.layers.{}."
        has = lambda key: key.format(0) in sd  # noqa: E731
        model = cls(c, qkv_bias=has(L + "self_attn.q_proj.bias"), o_bias=has(L + "self_attn.o_proj.bias"),
                    mlp_bias=has(L + "mlp.gate_proj.bias"))
        ours = {"embed.weight": sd["model.embed_tokens.weight"], "norm": sd["model.norm.weight"]}
        if model.lm_head is not None:
            ours["lm_head.weight"] = sd["lm_head.weight"]
        for i in range(c.n_layer):
            p = L.format(i)
            ours[f"layers.{i}.attn_norm"] = sd[p + "input_layernorm.weight"]
            ours[f"layers.{i}.mlp_norm"] = sd[p + "post_attention_layernorm.weight"]
            for kind in ("weight", "bias"):
                if (p + f"self_attn.q_proj.{kind}") in sd:
                    ours[f"layers.{i}.attn.qkv.{kind}"] = torch.cat(
                        [sd[p + f"self_attn.{n}_proj.{kind}"] for n in "qkv"])
                if (p + f"self_attn.o_proj.{kind}") in sd:
                    ours[f"layers.{i}.attn.o.{kind}"] = sd[p + f"self_attn.o_proj.{kind}"]
                if (p + f"mlp.gate_proj.{kind}") in sd:
                    ours[f"layers.{i}.gate_up.{kind}"] = torch.cat([sd[p + f"mlp.gate_proj.{kind}"],
                                                                    sd[p + f"mlp.up_proj.{kind}"]])
                    ours[f"layers.{i}.down.{kind}"] = sd[p + f"mlp.down_proj.{kind}"]
        model.load_state_dict({k: v.float() for k, v in ours.items()}, strict=True)
        return model

    def to_hf_state_dict(self, weights: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """transformers' LlamaForCausalLM keys of this model's weights (or of `weights`, its own state dict)."""
        c, own = self.config, weights if weights is not None else self.state_dict()
        sd = {"model.embed_tokens.weight": own["embed.weight"], "model.norm.weight": own["norm"]}
        if "lm_head.weight" in own:
            sd["lm_head.weight"] = own["lm_head.weight"]
        q, kv = c.n_head * c.head_dim, c.n_kv_head * c.head_dim
        for i in range(len(self.layers)):
            p, ours = f"model.layers.{i}.", f"layers.{i}."
            sd[p + "input_layernorm.weight"] = own[ours + "attn_norm"]
            sd[p + "post_attention_layernorm.weight"] = own[ours + "mlp_norm"]
            for kind in ("weight", "bias"):
                if (t := own.get(ours + f"attn.qkv.{kind}")) is not None:
                    for n, part in zip("qkv", t.split([q, kv, kv])):
                        sd[p + f"self_attn.{n}_proj.{kind}"] = part
                if (t := own.get(ours + f"attn.o.{kind}")) is not None:
                    sd[p + f"self_attn.o_proj.{kind}"] = t
                if (t := own.get(ours + f"gate_up.{kind}")) is not None:
                    gate, up = t.chunk(2)
                    sd[p + f"mlp.gate_proj.{kind}"], sd[p + f"mlp.up_proj.{kind}"] = gate, up
                    sd[p + f"mlp.down_proj.{kind}"] = own[ours + f"down.{kind}"]
        return {k: v.detach().cpu().contiguous() for k, v in sd.items()}
