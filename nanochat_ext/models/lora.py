"""--lora_r: LoRA through peft (the library's own layers, merge and adapter files), for the RM, GRPO and DPO.

peft injects its LoRA layers into the backbone's own module in place (`get_peft_model`), so every forward we have
(hidden states at scored positions, prefix trees, the KV-cache decoder, compiled blocks) runs through them
unchanged, and freezes every base weight. What trains is the adapters (and the RM's head); the base stays the input's.

- GRPO's reference is the same policy with its adapters switched off (peft's `disable_adapter`): no second copy of
  the model. LoRA's B starts at zero, so at step 1 the policy computes exactly as its reference.
- A LoRA checkpoint's model is peft's adapter directory (`model_<stamp>/`: adapter_config.json and
  adapter_model.safetensors, the tokenizer beside them), with the base referred to by path and fingerprint in the
  meta; `loader.load_backbone` takes it as a model (the base with the adapters merged by peft), and peft's
  `PeftModel.from_pretrained` onto the same base module takes it too. The RM's checkpoint holds its head and adapters.
- `--merge_lora`: the final checkpoint is the base with the adapters merged into it, written in the input's own layout
  (a nanochat model_<N>.pt, an HF dir, the RM's own file), which nanochat and every later stage load as any model.
  The adapters stay in its resume state.
Our Llama fuses q|k|v and gate|up, so its adapters sit on the fused projections: they load onto our module (and
merged, anywhere), not onto transformers' Llama.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from nanochat_ext.config import option
from nanochat_ext.errors import InputError, first_line
from nanochat_ext.models.backbone import Backbone

if TYPE_CHECKING:
    from peft import PeftModel

ADAPTER_CONFIG = "adapter_config.json"  # peft's: marks a directory of adapters
GATES = ("ve_gate",)  # nanochat's value-embedding gate (32 inputs, a few outputs): left out of the default targets


@dataclass(frozen=True)
class LoraSpec:
    """What --lora_* asked for: rank, alpha (the update is scaled by alpha / r), dropout on the adapters' input, and
    the target module names (None: every linear layer of the transformer blocks, see default_targets)."""
    r: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] | None = None

    @classmethod
    def from_meta(cls, meta: dict | None) -> LoraSpec | None:
        """The adapters a checkpoint's meta says to put on its model: None for none, or for adapters merged into its
        weights (--merge_lora)."""
        if not meta or meta.get("merged"):
            return None
        return cls(int(meta["r"]), float(meta["alpha"]), float(meta.get("dropout", 0.0)),
                   tuple(meta["targets"]) if meta.get("targets") else None)

    def to_meta(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class LoraConfig:
    """--lora_*: train LoRA adapters (peft) instead of the weights."""
    lora_r: int = option(0, "train LoRA adapters of this rank (peft) instead of the weights: no gradients or optimizer "
                         "state for the base, and GRPO's and DPO's reference is the base with the adapters off, no "
                         "second copy (0: no LoRA)", type=int,
                         check=(lambda v: v >= 0, ">= 0 (0: no LoRA, a full fine-tune)"))
    lora_alpha: float | None = option(None, "LoRA's alpha: updates scaled by alpha / r (default: 2 x --lora_r)",
                                      type=float, check=(lambda v: v > 0, "> 0"))
    lora_dropout: float | None = option(None, "dropout on the adapters' input while training (default: 0)", type=float,
                                        check=(lambda v: 0 <= v < 1, "in [0, 1)"))
    lora_targets: str | None = option(None, "comma-separated module names to adapt (default: every linear layer of the "
                                      "transformer blocks: nanochat's c_q,c_k,c_v,c_proj,c_fc; our Llama's fused "
                                      "qkv,o,gate_up,down; peft's 'all-linear' for other transformers models)")
    merge_lora: bool = option(False, "write the final checkpoint with the adapters merged into the base, in the "
                              "input's own layout (nanochat model_<N>.pt, an HF dir, an RM checkpoint), which nanochat "
                              "and every stage load; without it checkpoints hold the adapters (peft's adapter dir)",
                              action="store_true")

    def resolved(self, parallel: str) -> LoraConfig:
        """This config with its defaults written in (so a resume compares what the run trains with, given or not), or
        one line for a flag that needs --lora_r, or LoRA beside --parallel fsdp."""
        if not self.lora_r:
            given = [f for f in ("lora_alpha", "lora_dropout", "lora_targets") if getattr(self, f) is not None]
            given += ["merge_lora"] if self.merge_lora else []
            if given:
                raise InputError(f"--{given[0]} is for LoRA: give --lora_r too")
            return self
        if parallel == "fsdp":
            raise InputError("--lora_r trains adapters of ~1% of the weights, which --parallel fsdp would shard while "
                             "every rank still holds the whole base: train LoRA with --parallel ddp")
        alpha = self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_r
        return dataclasses.replace(self, lora_alpha=alpha, lora_dropout=self.lora_dropout or 0.0)

    @property
    def spec(self) -> LoraSpec | None:
        """The adapters a resolved config asks for (None: no LoRA)."""
        if not self.lora_r:
            return None
        targets = tuple(t.strip() for t in self.lora_targets.split(",") if t.strip()) if self.lora_targets else None
        return LoraSpec(self.lora_r, self.lora_alpha, self.lora_dropout, targets)


def default_targets(backbone: Backbone) -> tuple[str, ...] | str:
    """Every linear layer of the transformer blocks (as OpenRLHF's and peft's 'all-linear'), by module name: nanochat
    GPT's c_q, c_k, c_v, c_proj, c_fc (not its ve_gate); our Llama's fused qkv, o, gate_up, down. A transformers
    module: peft's 'all-linear' (every linear layer but the output head)."""
    if not backbone.native:
        return "all-linear"
    names = {name.rsplit(".", 1)[-1] for block in backbone.blocks for name, m in block.named_modules()
             if isinstance(m, nn.Linear)}
    return tuple(sorted(names - set(GATES)))


def targeted(name: str, targets: tuple[str, ...] | str) -> bool:
    """Whether a module of this name is a LoRA target, by peft's rule for a list of names (the name, or its last
    dotted part); 'all-linear' here: any but an output head."""
    return "lm_head" not in name if isinstance(targets, str) else name.rsplit(".", 1)[-1] in targets


def apply_lora(backbone: Backbone, spec: LoraSpec) -> PeftModel:
    """Inject peft's LoRA layers into backbone.model in place and freeze every base weight; returns the PeftModel,
    also kept as backbone.adapters (not a submodule: its parameters are backbone.model's)."""
    from peft import LoraConfig, get_peft_model

    targets = spec.targets or default_targets(backbone)
    if not isinstance(targets, str):  # peft adapts what matches and says nothing of a name that matches nothing
        names = [n for n, _ in backbone.model.named_modules()]
        unknown = [t for t in targets if not any(targeted(n, (t,)) for n in names)]
        if unknown:
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in backbone.model.named_modules()
                             if isinstance(m, nn.Linear)})
            raise InputError(f"--lora_targets: no module named {unknown[0]!r} in this {type(backbone.model).__name__} "
                             f"(its linear layers: {','.join(linear)})")
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout, bias="none",
                        target_modules=list(targets) if not isinstance(targets, str) else targets)
    try:
        adapters = get_peft_model(backbone.model, config)
    except ValueError as e:  # peft: no module matches, or a kind of layer it cannot adapt
        raise InputError(f"--lora_targets {','.join(targets) if not isinstance(targets, str) else targets}: "
                         f"{first_line(e, 200)}") from None
    object.__setattr__(backbone, "adapters", adapters)
    backbone.eval()  # peft's new dropout layers start in train mode; they drop only in training (dropout_active)
    return adapters


def describe(backbone: Backbone) -> str:
    """The log line of a run's LoRA: its settings, where peft put adapters, and their size."""
    config = backbone.adapters.peft_config["default"]
    targets = (config.target_modules if isinstance(config.target_modules, str)
               else ",".join(sorted(config.target_modules)))
    n = sum(p.numel() for p in backbone.parameters() if p.requires_grad)
    total = sum(p.numel() for p in backbone.parameters())
    return (f"lora: r {config.r}, alpha {config.lora_alpha:g}, dropout {config.lora_dropout:g} on {targets} (peft): "
            f"{n:,} adapter parameters train, {total - n:,} base parameters frozen")


def adapter_params(backbone: Backbone, spec: LoraSpec) -> int:
    """Parameters LoRA would train on backbone's linear layers named in spec's targets (default_targets where none
    are given): r x (in + out) each. The memory model's count, computed without injecting anything."""
    model, targets = backbone.model, spec.targets or default_targets(backbone)
    linear = [m for name, m in model.named_modules() if isinstance(m, nn.Linear) and targeted(name, targets)]
    return sum(spec.r * (m.in_features + m.out_features) for m in linear)


@contextlib.contextmanager
def dropout_active(backbone: Backbone) -> Iterator[None]:
    """--lora_dropout during a training micro-batch: the adapters' dropout in train mode, every other module as it
    is (our models run in eval mode throughout: nothing else of theirs depends on the mode). Its masks come from
    torch's global generator, which checkpoints do not keep: a resumed run with dropout draws other masks."""
    drops = [m for name, m in backbone.model.named_modules() if ".lora_dropout." in f".{name}."
             and isinstance(m, nn.Dropout)] if getattr(backbone, "adapters", None) is not None else []
    for m in drops:
        m.train()
    try:
        yield
    finally:
        for m in drops:
            m.eval()


class WithoutAdapters(nn.Module):
    """GRPO's and DPO's reference under LoRA: the policy's log-probs with its adapters switched off (peft's
    disable_adapter), that is the base model's, from the policy's own weights and code."""

    def __init__(self, logprobs: nn.Module, backbone: Backbone):
        super().__init__()
        self.logprobs = logprobs
        object.__setattr__(self, "adapters", backbone.adapters)

    def forward(self, *args: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        with self.adapters.disable_adapter():
            return self.logprobs(*args)


def adapter_state(backbone: Backbone) -> dict[str, torch.Tensor]:
    """The adapters' tensors as peft saves them (get_peft_model_state_dict), on CPU: for the resume state."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().cpu().clone()
            for k, v in get_peft_model_state_dict(backbone.adapters, save_embedding_layers=False).items()}


def load_adapter_state(backbone: Backbone, state: dict[str, torch.Tensor], path: Path) -> None:
    """Put adapter_state's tensors back (peft's set_peft_model_state_dict); one line when they do not fit."""
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(backbone.adapters, state)
    missing = [k for k in result.missing_keys if ".lora_" in k]
    if missing or result.unexpected_keys:
        raise InputError(f"the checkpoint's adapters do not fit this run's --lora_* (missing {missing[:2]}, "
                         f"unexpected {list(result.unexpected_keys)[:2]})", path=str(path))


def save_adapters(backbone: Backbone, directory: Path, tokenizer, base: dict) -> None:
    """peft's own adapter directory (save_pretrained: adapter_config.json + adapter_model.safetensors), the tokenizer
    beside them; `base` (portable paths of the base model) goes into the config's base_model_name_or_path."""
    adapters = backbone.adapters
    adapters.peft_config["default"].base_model_name_or_path = base["path"]
    adapters.save_pretrained(str(directory), save_embedding_layers=False)  # LoRA never changes embeddings
    tokenizer.save(directory)


# What a resumed run must keep, and what checkpoints from before LoRA were trained with.
RESUME_KEYS = ("lora_r", "lora_alpha", "lora_dropout", "lora_targets")
BEFORE_LORA = {"lora_r": 0, "lora_alpha": None, "lora_dropout": None, "lora_targets": None}


def is_adapter_dir(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / ADAPTER_CONFIG).is_file()


