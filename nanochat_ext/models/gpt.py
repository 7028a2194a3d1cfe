"""A nanochat-compatible GPT that loads every checkpoint layout nanochat has written since Oct 2025
and computes exactly what that nanochat commit computes.

Which vintage a checkpoint is, and what each changed, is vintages.py's; the GPT reads its behaviour
from `VINTAGES`. Parameter names match nanochat's, so its checkpoints load with strict=True and ours
load in nanochat.
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
from nanochat_ext.models.attention import (
    NO_WINDOW,
    KVCache,
    PrefixTree,
    add_mlp,
    attend,
    forward_span,
    rotary_slice,
    rows_at,
    static_masks,
)
from nanochat_ext.models.vintages import SMEAR_CHANNELS, VINTAGES, Vintage, pick_vintage


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
    def from_dict(cls, d: dict) -> GPTConfig:
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


def norm(x: torch.Tensor, eps: float | None = None) -> torch.Tensor:
    return F.rms_norm(x, (x.size(-1),), eps=eps)


def has_ve(layer_idx: int, n_layer: int) -> bool:
    """Value embeddings on alternating layers, the last one always included (nanochat's rule)."""
    return layer_idx % 2 == (n_layer - 1) % 2


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    d = x.shape[3] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos], 3).to(x.dtype)


def gate_input(x: torch.Tensor, channels: int) -> torch.Tensor:
    """x's first `channels` features, contiguous, for a gate's linear layer. On a strided 3-D input torch's
    matmul runs one folded mm when the weight requires grad and a bmm when it does not, which round
    differently: GRPO's frozen reference would then not give its policy's log-probs at equal weights."""
    return x[..., :channels].contiguous()


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
        q, k = norm(q, self.v.norm_eps), norm(k, self.v.norm_eps)
        if self.v.qk_scale != 1.0:
            q, k = q * self.v.qk_scale, k * self.v.qk_scale
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if kv_cache is not None:
            k, v = kv_cache.insert(layer_idx, k, v)
        y = attend(q, k, v, attn_mask, cached=kv_cache is not None)
        return self.c_proj(y.transpose(1, 2).reshape(B, q.size(2), -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.eps = config.v.norm_eps
        self.attn = CausalSelfAttention(config, layer_idx)
        self.mlp = MLP(config)

    def forward(self, x, ve, cos_sin, attn_mask, kv_cache=None, at=None, real_tokens=None):
        """at (B, K): the block's output only at those positions, (B, K, C). real_tokens: the positions
        of padded rows that are not padding, for the MLP (add_mlp); unused with `at`, which picks rows."""
        h = self.attn(norm(x, self.eps), ve, cos_sin, attn_mask, kv_cache, self.layer_idx, at)
        x = (x if at is None else rows_at(x, at)) + h
        return add_mlp(x, lambda t: self.mlp(norm(t, self.eps)), real_tokens if at is None else None)


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
        v = self.config.v
        return torch.bfloat16 if v.rotary_bf16 or (device.type == "cuda" and v.rotary_bf16_on_cuda) else torch.float32

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
        s = forward_span(idx, key_mask, kv_cache, tree, at, self.window_sizes, self.rotary.size(0))
        table = rotary_slice(self.rotary, s.positions, s.T0, idx.size(1))
        table = table.to(self._rotary_dtype(idx.device))  # a no-op on CPU
        cos_sin = table[:, :, None, 0], table[:, :, None, 1]  # (1 or B, T, 1, head_dim / 2)
        x = norm(self.transformer.wte(idx), self.config.v.norm_eps)
        if self.config.v.smear:
            x = self._smear(x, s.positions, kv_cache, tree.prev if tree is not None else None)
        x = self._trunk(idx, x, cos_sin, s.masks, kv_cache, s.at, tree.real_tokens if tree is not None else None)
        return x[:, 0] if s.single else x

    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor,
                    kv_cache: KVCache) -> torch.Tensor:
        """One token per row (B,) against a static cache (kv_cache.slot set): static shapes throughout,
        so torch.compile captures it whole. positions (B,): each row's position for the token;
        key_valid (B, L): the cache slots each row may see, the token's own slot included. Logits (B, V)."""
        table = self.rotary[positions[:, None]].to(self._rotary_dtype(tokens.device))  # (B, 1, 2, head_dim / 2)
        cos_sin = table[:, :, None, 0], table[:, :, None, 1]
        masks = static_masks(key_valid, kv_cache.slot, self.window_sizes)
        x = norm(self.transformer.wte(tokens[:, None]), self.config.v.norm_eps)
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
        return norm(x, v.norm_eps)

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

    def to_hf_state_dict(self, weights: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """transformers' NanoChatForCausalLM keys of this model's weights (or of `weights`, its own state dict): a
        model of the "transformers" vintage saved back as the Hugging Face dir it came from."""
        own = weights if weights is not None else self.state_dict()
        sd = {"model.embed_tokens.weight": own["transformer.wte.weight"], "lm_head.weight": own["lm_head.weight"]}
        for i in range(self.config.n_layer):
            for theirs, name in _HF_NAMES.items():
                sd[f"model.layers.{i}.{theirs}.weight"] = own[f"transformer.h.{i}.{name}.weight"]
        return {k: v.detach().cpu().contiguous() for k, v in sd.items()}


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
        raise InputError(f"model_config does not describe a nanochat GPT: {e}", path=path, field="model_config") from e
    check_layout(model, state, path)
    model.load_state_dict(state, strict=True)
    return model


def padded(vocab_size: int, multiple: int = 64) -> int:
    return math.ceil(vocab_size / multiple) * multiple


# ---- transformers' port of nanochat (model_type "nanochat") -----------------------------------------------------
_HF_NAMES = {"self_attn.q_proj": "attn.c_q", "self_attn.k_proj": "attn.c_k", "self_attn.v_proj": "attn.c_v",
             "self_attn.o_proj": "attn.c_proj", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}


def config_from_hf(cfg) -> GPTConfig | None:
    """Our config for a transformers NanoChatConfig whose forward the "transformers" vintage computes, or None (any
    other model type, or a nanochat config that departs from it: it then runs on transformers' own module)."""
    rope = getattr(cfg, "rope_parameters", None) or {}
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    v = VINTAGES["transformers"]
    fits = (cfg.model_type == "nanochat" and rope.get("rope_type", "default") == "default"
            and float(rope.get("rope_theta", 10000.0)) == v.rotary_base and cfg.hidden_act == "relu2"
            and cfg.final_logit_softcapping == v.softcap and cfg.rms_norm_eps == v.norm_eps
            and cfg.intermediate_size == 4 * cfg.hidden_size and not cfg.attention_bias
            and not cfg.tie_word_embeddings and head_dim * cfg.num_attention_heads == cfg.hidden_size)
    if not fits:
        return None
    return GPTConfig(sequence_len=cfg.max_position_embeddings, vocab_size=cfg.vocab_size,
                     n_layer=cfg.num_hidden_layers, n_head=cfg.num_attention_heads,
                     n_kv_head=cfg.num_key_value_heads or cfg.num_attention_heads, n_embd=cfg.hidden_size,
                     vintage="transformers")


def gpt_from_hf_state_dict(config: GPTConfig, sd: dict[str, torch.Tensor], path: str) -> GPT:
    """Our GPT with the weights of transformers' NanoChatForCausalLM (its state dict sd)."""
    ours = {"transformer.wte.weight": sd["model.embed_tokens.weight"], "lm_head.weight": sd["lm_head.weight"]}
    for k, t in sd.items():
        parts = k.split(".")  # model.layers.<i>.<module>.<proj>.weight
        if parts[:2] == ["model", "layers"] and ".".join(parts[3:5]) in _HF_NAMES:
            ours[f"transformer.h.{parts[2]}.{_HF_NAMES['.'.join(parts[3:5])]}.{parts[5]}"] = t
    unmapped = [k for k in sd if k not in ("model.embed_tokens.weight", "lm_head.weight")
                and not (k.startswith("model.layers.") and ".".join(k.split(".")[3:5]) in _HF_NAMES)]
    if unmapped:
        raise InputError(f"weights transformers' nanochat port does not have: {_shorten(unmapped)}", path=path)
    model = GPT(config)
    check_layout(model, ours, path)
    model.load_state_dict({k: v.float() for k, v in ours.items()}, strict=True)
    return model

