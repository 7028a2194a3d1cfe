"""Reward models as transformers sequence classifiers (`*ForSequenceClassification` with num_labels 1), out and
in: the form most public RMs ship in, and what transformers, TRL and vLLM load.

Out: an RM trained here on a Hugging Face backbone is written as such a directory (safetensors weights, the config
with num_labels 1 and the pad token, the tokenizer): the backbone's weights under the base model's own names and
our head as `score`. transformers scores a sequence at its last token that is not the pad token, which is where
ours reads it, so it gives our scores.
In: such a directory as --rm, written by us or by transformers itself. The Llama family runs as our native model
(batched, prompts shared); any other architecture through transformers' own base model. Either way a sequence is
scored where transformers scores it.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import shutil
from pathlib import Path

import torch

from nanochat_ext.backbone import Backbone, load_tokenizer_for, quiet_transformers
from nanochat_ext.errors import InputError, from_outside
from nanochat_ext.llama import Llama, config_from_hf
from nanochat_ext.lora import merged_weights
from nanochat_ext.reward import RewardModel, RewardScorer, load_reward_model

def load_hf_classifier(path: str | os.PathLike, device: torch.device | str = "cpu") -> RewardScorer:
    """A transformers sequence classifier with one label, ready to score as load_reward_model's RMs do (fp32)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    quiet_transformers()
    d = Path(path)
    with from_outside("Hugging Face classifier", d):
        config = AutoConfig.from_pretrained(str(d), local_files_only=True)
    if config.num_labels != 1:
        raise InputError(f"a classifier of {config.num_labels} labels, not a reward model (num_labels 1)",
                         path=str(d / "config.json"), field="num_labels")
    with from_outside("Hugging Face classifier", d):
        hf = AutoModelForSequenceClassification.from_pretrained(str(d), local_files_only=True, dtype=torch.float32)
    state, architecture = hf.state_dict(), type(hf).__name__
    if "score.weight" not in state or "score.bias" in state:
        raise InputError("no bias-free `score` head of one output, as transformers' reward classifiers have", path=str(d))
    native = config_from_hf(hf.config)
    if native is not None:  # the LM head is not needed to score: tie it to the embedding rather than invent one
        body = Llama.from_hf_state_dict(dataclasses.replace(native, tie_word_embeddings=True), state)
        backbone = Backbone("hf", body, str(d), hf_config=hf.config)
        del hf  # not held twice
    else:
        backbone = Backbone("hf", hf, str(d))  # scored through hf.base_model; its own score sits unused
    model = RewardModel(backbone).to(device)
    with torch.no_grad():
        model.head.weight.copy_(state["score.weight"])
    model.requires_grad_(False)
    tokenizer = load_tokenizer_for(backbone, d)
    # The tokenizer's model_max_length, where it sets one (ours: the length the RM was trained on), else the context.
    said = tokenizer._impl.model_max_length
    max_len = min(backbone.max_seq_len, said) if isinstance(said, int) and said < 1 << 30 else backbone.max_seq_len
    meta = {"kind": "reward_model", "format": "hf", "max_len": max_len, "architecture": architecture}
    return RewardScorer(model.eval(), tokenizer, max_len, meta, path=d, pad_id=config.pad_token_id)


def export_hf_classifier(path: str | os.PathLike, out_dir: str | os.PathLike,
                         backbone: str | os.PathLike | None = None) -> Path:
    """Write an RM trained on a Hugging Face backbone as a transformers sequence-classifier directory (fp32
    safetensors, config, tokenizer) in out_dir (new or empty), all at once. Returns out_dir."""
    from transformers import AutoModelForSequenceClassification

    quiet_transformers()
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise InputError("export dir is not empty", path=str(out))
    scorer = load_reward_model(path, "cpu", backbone=backbone)
    bb, tok = scorer.model.backbone, scorer.tokenizer
    if bb.kind != "hf" or tok.kind != "hf":
        raise InputError("--format hf writes RMs on a Hugging Face backbone; one on a nanochat backbone keeps this "
                         "project's format (--format native), which nanochat_ext and its --rm load", path=str(path))
    if tok.pad_id == tok.eos_id:
        raise InputError("the tokenizer pads with its EOS token, so transformers would score the token before each "
                         "response's EOS, not the EOS this RM was trained to score; give the tokenizer a pad token",
                         path=str(tok.source))
    config = copy.deepcopy(bb.hf_config if bb.native else bb.model.config)
    config.num_labels, config.pad_token_id = 1, tok.pad_id
    with from_outside(f"a sequence classifier of {type(config).__name__}", path):  # one the architecture may lack
        classifier = AutoModelForSequenceClassification.from_config(config)
    config.architectures = [type(classifier).__name__]
    own = merged_weights(bb) if bb.adapters is not None else None  # a LoRA RM: its adapters merged in (peft's delta)
    body = bb.model.to_hf_state_dict(own) if bb.native else (own or bb.model.state_dict())
    base = classifier.base_model_prefix + "."  # the base model's weights, whatever its LM head is called
    state = {k: v.float() for k, v in body.items() if k.startswith(base)}
    state["score.weight"] = scorer.model.head.weight.detach().float()
    missing, unexpected = classifier.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise InputError(f"the backbone's weights do not fit {type(classifier).__name__} (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})", path=str(path))
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    classifier.save_pretrained(str(staging), safe_serialization=True)
    tok._impl.model_max_length = scorer.max_len  # the length it was trained on, read back as its max_len
    tok.save(staging)
    if out.exists():
        out.rmdir()
    os.replace(staging, out)
    return out
