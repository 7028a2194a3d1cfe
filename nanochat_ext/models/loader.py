"""The one way in: every model, tokenizer, LoRA checkpoint, reward model and Hugging Face classifier this project
reads is loaded here, and reward models are written out here (as nanochat_ext's own files or as a transformers
classifier). What it builds lives in the modules below it (backbone, lora, reward), none of which loads a file.

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

import copy
import dataclasses
import os
import shutil
from pathlib import Path

import torch

from nanochat_ext.ddp_common import print0
from nanochat_ext.errors import InputError, first_line, from_outside
from nanochat_ext.models.backbone import Backbone, hold_frozen_in
from nanochat_ext.models.gpt import (GPT, config_from_hf as gpt_config_from_hf, gpt_from_checkpoint,
                                     gpt_from_hf_state_dict)
from nanochat_ext.models.llama import Llama, config_from_hf
from nanochat_ext.models.lora import LoraSpec, apply_lora, is_adapter_dir
from nanochat_ext.models.reward_model import RewardModel, RewardScorer
from nanochat_ext.runtime.checkpoint import (complete_checkpoints, find_checkpoint, fingerprint, first_loadable,
                                             incomplete_reason, locate, read_json, resolve_model_path, save_checkpoint,
                                             stamp_digits, torch_load)
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


def _load_nanochat(model_file: Path, meta_file: Path, device: torch.device | str, vintage: str | None) -> Backbone:
    meta = read_json(meta_file)
    if isinstance(meta, dict) and meta.get("kind") == "reward_model":
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
    fits = tok.vocab_size == backbone.vocab_size if backbone.kind == "nanochat" else tok.vocab_size <= backbone.vocab_size
    if not fits:
        rows = backbone.model.transformer.wte.weight.shape[0] if isinstance(backbone.model, GPT) else backbone.vocab_size
        raise InputError(f"tokenizer has {tok.vocab_size} ids but the backbone's vocab_size is {backbone.vocab_size} "
                         f"({rows} embedding rows): they do not belong together", path=tok.source)
    beyond = [i for i in tok.stop_ids if i >= backbone.vocab_size]
    if beyond:
        raise InputError(f"stop ids {beyond} are beyond the backbone's {backbone.vocab_size} ids",
                         path=str(tok.generation_config or tok.source), field="eos_token_id")
    return tok



# ---- LoRA checkpoints -----------------------------------------------------------------------------
def load_adapted(adapter_dir: Path, meta: dict, meta_path: Path, device: torch.device | str,
                 vintage: str | None) -> "Backbone":
    """A LoRA checkpoint as a model: its base (found by the meta's portable paths, refused if its fingerprint changed;
    in the nanochat vintage it was trained as) with the adapters loaded by peft (PeftModel.from_pretrained) and
    merged into it (merge_and_unload)."""
    from peft import PeftModel


    ref = (meta.get("lora") or {}).get("base")
    if not ref:
        raise InputError("an adapter directory whose meta names no base model ('lora.base')", path=str(meta_path))
    where = locate(ref, adapter_dir.parent)
    if where is None:
        raise InputError(f"the base model of these adapters is not at {adapter_dir.parent / ref['relative_to_checkpoint']}"
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


def merged_weights(backbone: "Backbone", adapted_only: bool = False) -> dict[str, torch.Tensor]:
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



# ---- reward models --------------------------------------------------------------------------------
def load_reward_model(path: str | os.PathLike, device: torch.device | str = "cpu",
                      backbone: str | os.PathLike | None = None) -> RewardScorer:
    """An RM checkpoint file (model_<stamp>.pt) or a directory (its newest complete checkpoint), set to
    score in the precision it was trained in (checkpoints without a recorded dtype: fp32).

    The backbone: `backbone` if given, else found from the meta (relative to the RM's dir, then to
    $NANOCHAT_BASE_DIR, then the absolute path), and refused when its fingerprint is not the one the
    head was trained on. Checkpoints from before fingerprints load by their absolute path, with a
    warning that they cannot be verified.
    A transformers sequence classifier's directory loads as one too (load_hf_classifier)."""
    if is_hf_classifier(path):
        return load_hf_classifier(path, device)
    if not complete_checkpoints(path):
        raise InputError("no reward-model checkpoint (model_<stamp>.pt + meta_<stamp>.json)", path=str(path))
    model_path, model, tokenizer, meta, state, dtype = first_loadable(
        path, lambda m, meta: (m, *_load_rm_files(m, meta, device, backbone)))
    # As in training: what was frozen is held in the compute dtype, what trained keeps fp32 (the head too).
    for name, p in model.backbone.named_parameters():
        p.requires_grad_(f"backbone.{name}" in state)
    hold_frozen_in(model.backbone, dtype)
    model.requires_grad_(False)
    return RewardScorer(model, tokenizer, int(meta["max_len"]), meta, dtype, model_path)


def _load_rm_files(model_path: Path, meta_path: Path, device: torch.device | str,
                   override: str | os.PathLike | None) -> tuple:
    """(RewardModel with its head loaded, tokenizer, meta, state dict, scoring dtype); one line for a bad file."""
    meta = read_json(meta_path)
    if not isinstance(meta, dict) or meta.get("kind") != "reward_model":
        raise InputError("not a reward-model checkpoint (meta 'kind' is not 'reward_model')", path=str(meta_path))
    dtype_name = meta.get("dtype", "float32")
    if dtype_name not in ("float32", "bfloat16"):
        raise InputError(f"unknown dtype {dtype_name!r} (float32 or bfloat16)", path=str(meta_path), field="dtype")
    state = torch_load(model_path, "reward-model checkpoint", map_location=device)
    ref, rm_dir = meta.get("backbone_ref"), model_path.parent
    if override is not None:
        where = Path(override)
    elif ref is not None:
        where = locate(ref, rm_dir)
        if where is None:
            raise InputError(f"the RM's backbone is not at {rm_dir / ref['relative_to_checkpoint']}, nor under "
                             f"$NANOCHAT_BASE_DIR/{ref['relative_to_base_dir']}, nor at {ref['path']}; give its path "
                             f"(--rm_backbone)", path=str(meta_path))
    else:
        where = Path(meta["backbone"])
        print0(f"warning: {meta_path} predates backbone fingerprints: the backbone {where} cannot be verified")
    backbone = load_backbone(where, device, vintage=meta.get("backbone_vintage"))
    if ref is not None and fingerprint(backbone.source) != ref["fingerprint"]:
        raise InputError(f"the backbone {backbone.source} is not the one this RM was trained on ({ref['path']}): "
                         f"their weights differ (fingerprint)", path=str(meta_path))
    model = RewardModel(backbone).to(device)
    if (spec := LoraSpec.from_meta(meta.get("lora"))) is not None:  # trained with --lora_r: its adapters, by peft
        apply_lora(backbone, spec)
    tok_ref = meta.get("tokenizer_ref")
    tok_path = (locate(tok_ref, rm_dir) if tok_ref else None) or (None if override is not None else meta["tokenizer"])
    tokenizer = load_tokenizer_for(backbone, tok_path)
    missing = [k for k in ("head.weight",) if k not in state]
    unknown = [k for k in state if k not in dict(model.named_parameters())]
    if missing or unknown:
        raise InputError(f"checkpoint does not fit its backbone (missing {missing}, unknown {unknown[:3]})",
                         path=str(model_path))
    model.load_state_dict(state, strict=False)
    return model, tokenizer, meta, state, getattr(torch, dtype_name)


def export_reward_model(path: str | os.PathLike, out_dir: str | os.PathLike,
                        backbone: str | os.PathLike | None = None) -> Path:
    """A self-contained copy of an RM checkpoint: out_dir holds the head (model_<stamp>.pt + meta), the
    backbone in its own layout under backbone/ (nanochat model + meta, or the HF dir) and the tokenizer
    under tokenizer/, and the meta points at them relative to out_dir. Loads with no other file, on any
    machine. The backbone is checked against the RM's fingerprint first. Returns the model path."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise InputError("export dir is not empty", path=str(out))
    scorer = load_reward_model(path, "cpu", backbone=backbone)  # finds and verifies the backbone
    if scorer.meta.get("format") == "hf":
        raise InputError("a transformers sequence classifier is self-contained already: copy its directory",
                         path=str(path))
    model_path, meta = scorer.path, dict(scorer.meta)
    source, tok_source = Path(scorer.model.backbone.source), Path(scorer.tokenizer.source)
    if is_adapter_dir(source):
        raise InputError(f"the RM's backbone {source} is a LoRA checkpoint, which needs its base beside it: export an "
                         f"RM on its merged model (the run's --merge_lora, or --consolidate DIR)", path=str(path))
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    if source.is_dir():  # a Hugging Face dir
        shutil.copytree(source, staging / "backbone")
        bb = staging / "backbone"
    else:  # a nanochat checkpoint: the model file and its meta
        (staging / "backbone").mkdir(parents=True)
        for f in (source, source.with_name(f"meta_{stamp_digits(source)}.json")):
            shutil.copyfile(f, staging / "backbone" / f.name)
        bb = staging / "backbone" / source.name
    if tok_source.is_dir():
        shutil.copytree(tok_source, staging / "tokenizer")
    else:
        (staging / "tokenizer").mkdir()
        for f in (tok_source, tok_source.with_name("token_bytes.pt")):
            if f.is_file():
                shutil.copyfile(f, staging / "tokenizer" / f.name)
    final_bb = out / bb.relative_to(staging)
    stamp = int(stamp_digits(model_path))
    meta.update({"backbone": str(final_bb.resolve()), "tokenizer": str((out / "tokenizer").resolve()),
                 "backbone_ref": {"path": str(final_bb.resolve()), "relative_to_checkpoint": str(bb.relative_to(staging)),
                                  "relative_to_base_dir": None, "fingerprint": fingerprint(bb)},
                 "tokenizer_ref": {"path": str((out / "tokenizer").resolve()), "relative_to_checkpoint": "tokenizer",
                                   "relative_to_base_dir": None},
                 "exported_from": str(model_path.resolve())})
    save_checkpoint(staging, stamp, torch_load(model_path, "reward-model checkpoint"), meta)
    if out.exists():
        out.rmdir()
    os.replace(staging, out)
    return out / model_path.name


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
