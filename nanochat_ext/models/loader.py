"""The one way in for models: every model, tokenizer and LoRA checkpoint this project reads is loaded here (reward
models and Hugging Face classifiers: reward_model.py). What it builds lives in the modules below it (backbone, lora),
none of which loads a file.

Models: a nanochat checkpoint (a dir: its largest model_<N>.pt with the meta of the same N; a model_<N>.pt file; a
checkpoints root such as chatsft_checkpoints/, taking its largest d<N> tag; or base|sft|rl[:tag] under
$NANOCHAT_BASE_DIR) runs on our GPT; a local Hugging Face causal-LM dir of the Llama family on our native Llama, any
other architecture on transformers' own module; a LoRA checkpoint (peft's adapter dir) is its base with the adapters
merged by peft. Nothing is downloaded (local_files_only), and transformers never gets trust_remote_code.

Reward models in transformers' form (`*ForSequenceClassification` with num_labels 1): the form most public RMs ship
in, and what transformers, TRL and vLLM load. Out: an RM trained here on a Hugging Face backbone is written as such a
directory (safetensors weights, the config with num_labels 1 and the pad token, the tokenizer): the backbone's
weights under the base model's own names and our head as `score`. transformers scores a sequence at its last token
that is not the pad token, which is where ours reads it, so it gives our scores. In: such a directory as --rm,
written by us or by transformers itself; the Llama family runs as our native model (batched, prompts shared), any
other architecture through transformers' own base model, and either way a sequence is scored where transformers
scores it.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from nanochat_ext.errors import InputError, first_line, from_outside
from nanochat_ext.models.backbone import Backbone, hold_frozen_in
from nanochat_ext.models.gpt import GPT, gpt_from_checkpoint, gpt_from_hf_state_dict
from nanochat_ext.models.gpt import config_from_hf as gpt_config_from_hf
from nanochat_ext.models.llama import Llama, config_from_hf
from nanochat_ext.models.lora import is_adapter_dir
from nanochat_ext.runtime.checkpoint import (
    find_checkpoint,
    fingerprint,
    first_loadable,
    incomplete_reason,
    locate,
    read_json,
    resolve_model_path,
    torch_load,
)
from nanochat_ext.tokenizer import TokenizerWrapper


# ---- models and tokenizers --------------------------------------------------------------------------
def is_hf_classifier(path: str | os.PathLike) -> bool:
    """Whether path is a transformers directory whose config names a sequence-classification architecture (a
    reward model in Hugging Face form: load_hf_classifier)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    meta = read_json(config, "config")
    return isinstance(meta, dict) and any(str(a).endswith("ForSequenceClassification")
                                          for a in meta.get("architectures") or [])


def load_backbone(path: str | os.PathLike, device: torch.device | str = "cpu", native: bool = True,
                  vintage: str | None = None, frozen: torch.dtype | None = None) -> Backbone:
    """A nanochat checkpoint (a dir: its largest model_<N>.pt with the meta of the same N; a
    model_<N>.pt file; a checkpoints root such as chatsft_checkpoints/, taking its largest d<N> tag;
    or the short form base|sft|rl[:tag] under $NANOCHAT_BASE_DIR), or a local HF dir.
    vintage picks the nanochat vintage where the checkpoint cannot tell (see vintages.VINTAGES).
    native=False keeps transformers' own module even for the Llama family (used to cross-check).
    frozen: load for inference only (no gradients), weights held in that compute dtype."""
    if frozen is not None:
        return hold_frozen_in(load_backbone(path, device, native, vintage).requires_grad_(False), frozen)
    p = resolve_model_path(path)
    if not p.exists():
        raise InputError("backbone path does not exist", path=str(p))
    found = find_checkpoint(p)
    if found is not None and is_adapter_dir(found[0]):  # a LoRA checkpoint: its base, the adapters merged in
        return load_adapted(found[0], read_json(found[1]), found[1], device, vintage)
    if found is not None and found[0].is_dir():  # a policy saved by GRPO as an HF dir
        p = found[0]
    elif found is not None:  # the newest that loads: a corrupt one is skipped with a warning
        return first_loadable(p, lambda model, meta: _load_nanochat(model, meta, device, vintage))
    if p.is_dir() and (p / "config.json").is_file():
        from transformers import AutoModelForCausalLM

        quiet_transformers()
        if is_hf_classifier(p):
            raise InputError("a reward model (a sequence classifier), not a causal LM: give it as --rm", path=str(p))
        with from_outside("Hugging Face model", p):
            hf = AutoModelForCausalLM.from_pretrained(str(p), local_files_only=True, dtype=torch.float32)
        cfg = config_from_hf(hf.config) if native else None
        if cfg is not None:
            model = Llama.from_hf_state_dict(cfg, hf.state_dict())
            return Backbone("hf", model.to(device), str(p), hf_config=hf.config).eval()
        gpt_cfg = gpt_config_from_hf(hf.config) if native else None
        if gpt_cfg is not None:  # transformers' nanochat port: our GPT computes its forward
            model = gpt_from_hf_state_dict(gpt_cfg, hf.state_dict(), str(p))
            return Backbone("hf", model.to(device), str(p), hf_config=hf.config).eval()
        return Backbone("hf", hf.to(device), str(p)).eval()
    reason = incomplete_reason(p)
    raise InputError(f"incomplete checkpoint: {reason}" if reason else
                     "not a checkpoint: expected model_<N>.pt + meta_<N>.json (nanochat), a checkpoints root "
                     "with d<N> tags, or config.json (Hugging Face causal LM)", path=str(p))


RM_KIND = "reward_model"  # a reward-model checkpoint's meta kind (models/reward_model.py writes it)


def _load_nanochat(model_file: Path, meta_file: Path, device: torch.device | str, vintage: str | None) -> Backbone:
    meta = read_json(meta_file)
    if isinstance(meta, dict) and meta.get("kind") == RM_KIND:
        raise InputError("a reward-model checkpoint, not a model: give it as --rm", path=str(meta_file))
    if not isinstance(meta, dict) or not isinstance(meta.get("model_config"), dict):
        raise InputError("meta json has no 'model_config'", path=str(meta_file), field="model_config")
    state = torch_load(model_file, "checkpoint")
    state = {k.removeprefix("_orig_mod."): v for k, v in state.items()}  # saved from a torch.compile'd model
    dtypes = {k: v.dtype for k, v in state.items()}
    model = gpt_from_checkpoint({k: v.float() for k, v in state.items()}, meta, vintage, str(model_file))
    return Backbone("nanochat", model.to(device), str(model_file), source_meta=meta, source_dtypes=dtypes).eval()


def quiet_transformers() -> None:
    """No per-load progress bars or info chatter from transformers: our logs stay one line per event."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def default_tokenizer_path(backbone_path: str | os.PathLike) -> Path:
    """Where a backbone's tokenizer lives: beside it, in nanochat's base-dir layout, or in
    $NANOCHAT_BASE_DIR/tokenizer."""
    p = Path(backbone_path)
    d = p if p.is_dir() else p.parent
    candidates = [d, d / "tokenizer", d.parent / "tokenizer", d.parent.parent / "tokenizer"]
    base = os.environ.get("NANOCHAT_BASE_DIR")
    if base:
        candidates.append(Path(base) / "tokenizer")
    for c in candidates:
        if (c / "tokenizer.pkl").is_file() or (c / "tokenizer.json").is_file():
            return c
    raise InputError("no tokenizer found beside the backbone or in $NANOCHAT_BASE_DIR/tokenizer; "
                     "pass --tokenizer", path=str(p))


def load_tokenizer_for(backbone: Backbone, tokenizer_path: str | os.PathLike | None) -> TokenizerWrapper:
    """Load the tokenizer and check that its ids fit the backbone's embedding table."""
    path = tokenizer_path or default_tokenizer_path(backbone.source)
    tok = TokenizerWrapper.load(path, model_dir=backbone.source if backbone.kind == "hf" else None)
    # nanochat asserts equality (its padded embedding rows beyond vocab_size are never produced);
    # HF models often embed more rows than their tokenizer uses.
    fits = (tok.vocab_size == backbone.vocab_size if backbone.kind == "nanochat"
            else tok.vocab_size <= backbone.vocab_size)
    if not fits:
        rows = (backbone.model.transformer.wte.weight.shape[0] if isinstance(backbone.model, GPT)
                else backbone.vocab_size)
        raise InputError(f"tokenizer has {tok.vocab_size} ids but the backbone's vocab_size is {backbone.vocab_size} "
                         f"({rows} embedding rows): they do not belong together", path=tok.source)
    beyond = [i for i in tok.stop_ids if i >= backbone.vocab_size]
    if beyond:
        raise InputError(f"stop ids {beyond} are beyond the backbone's {backbone.vocab_size} ids",
                         path=str(tok.generation_config or tok.source), field="eos_token_id")
    return tok



# ---- LoRA checkpoints -----------------------------------------------------------------------------
def load_adapted(adapter_dir: Path, meta: dict, meta_path: Path, device: torch.device | str,
                 vintage: str | None) -> Backbone:
    """A LoRA checkpoint as a model: its base (found by the meta's portable paths, refused if its fingerprint changed;
    in the nanochat vintage it was trained as) with the adapters loaded by peft (PeftModel.from_pretrained) and
    merged into it (merge_and_unload)."""
    from peft import PeftModel


    ref = (meta.get("lora") or {}).get("base")
    if not ref:
        raise InputError("an adapter directory whose meta names no base model ('lora.base')", path=str(meta_path))
    where = locate(ref, adapter_dir.parent)
    if where is None:
        raise InputError("the base model of these adapters is not at "
                         f"{adapter_dir.parent / ref['relative_to_checkpoint']}"
                         f", nor under $NANOCHAT_BASE_DIR/{ref['relative_to_base_dir']}, nor at {ref['path']}: put it "
                         f"back, or merge the adapters where it is (--merge_lora, --consolidate)", path=str(meta_path))
    backbone = load_backbone(where, device, vintage=vintage or ref.get("vintage"))
    if fingerprint(backbone.source) != ref["fingerprint"]:
        raise InputError(f"the base model {backbone.source} is not the one these adapters were trained on: its "
                         f"weights differ (fingerprint)", path=str(meta_path))
    try:
        merged = PeftModel.from_pretrained(backbone.model, str(adapter_dir)).merge_and_unload()
    except (ValueError, RuntimeError, OSError, KeyError, TypeError) as e:  # a garbled adapter config or file
        raise InputError(f"cannot load the adapters ({first_line(e, 200)})", path=str(adapter_dir)) from None
    backbone.model = merged
    backbone.source = str(adapter_dir)
    return backbone


def merged_weights(backbone: Backbone, adapted_only: bool = False) -> dict[str, torch.Tensor]:
    """backbone.model's state dict in its own names (no peft layers) with every adapter merged into its base weight,
    fp32 on CPU: the base as loaded from its source again (not the copy held in bf16 while training) plus each LoRA
    layer's delta as peft computes it (get_delta_weight). adapted_only: the merged weights alone. backbone itself is
    left as it is."""
    from peft.tuners.lora import LoraLayer

    base = load_backbone(backbone.source, "cpu", vintage=backbone.vintage).model.state_dict()
    deltas = {f"{name}.weight": m.get_delta_weight("default").detach().float().cpu()
              for name, m in backbone.model.named_modules() if isinstance(m, LoraLayer) and "default" in m.lora_A}
    keep = deltas if adapted_only else base
    return {k: base[k].float() + deltas[k] if k in deltas else base[k] for k in keep}
