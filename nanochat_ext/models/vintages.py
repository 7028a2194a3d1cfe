"""nanochat's vintages: what each era of its forward pass computes, and which one wrote a checkpoint.

nanochat has no version field: what a checkpoint needs is told apart by its state-dict keys and
shapes (and, for the one week the keys cannot tell, by the meta or the user). `VINTAGES` is the one
place that says what each vintage changed; the GPT (gpt.py) reads its behaviour from it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanochat_ext.errors import InputError


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
    norm_eps: float | None = None  # the rms-norms' epsilon (None: torch's default, the dtype's machine epsilon)
    rotary_bf16_on_cuda: bool = True  # nanochat computes in bf16 on CUDA, its rotary table included

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
    # transformers' port of nanochat (model_type "nanochat", NanoChatForCausalLM): oct2025's forward pass with its
    # rms-norms at epsilon 1e-6 and the rotary table in fp32 on every device. Hugging Face dirs only
    # (gpt.config_from_hf).
    Vintage("transformers", "transformers' NanoChatForCausalLM (Hugging Face dirs of model_type nanochat)",
            pads_vocab=False, rotary_bf16=False, norm_eps=1e-6, rotary_bf16_on_cuda=False),
]}
NANOCHAT_WRITTEN = [name for name in VINTAGES if name != "transformers"]  # what a nanochat checkpoint can be
SMEAR_CHANNELS = 24
VINTAGE_FLAG = "--nanochat_vintage"


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
        if requested not in NANOCHAT_WRITTEN:
            raise InputError(f"{VINTAGE_FLAG} {requested!r} is not a nanochat vintage; known: "
                             f"{', '.join(NANOCHAT_WRITTEN)}")
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
