"""The reward model: a backbone with a linear head read at the last real token; the scorer a trained RM scores
through; and its files: an RM checkpoint found, checked against its backbone's fingerprint and loaded, exported
self-contained or as a transformers sequence classifier, and such a classifier loaded as an RM (its loss and training:
algorithms/rm.py).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import shutil
from pathlib import Path

import torch
import torch.nn as nn

from nanochat_ext.data.batching import prefix_tree_rows, right_pad, truncate
from nanochat_ext.ddp_common import print0
from nanochat_ext.errors import InputError, from_outside
from nanochat_ext.models.backbone import Backbone, hold_frozen_in
from nanochat_ext.models.llama import Llama, config_from_hf
from nanochat_ext.models.loader import (
    RM_KIND,
    is_hf_classifier,
    load_backbone,
    load_tokenizer_for,
    merged_weights,
    quiet_transformers,
)
from nanochat_ext.models.lora import LoraSpec, apply_lora, is_adapter_dir
from nanochat_ext.runtime.checkpoint import (
    complete_checkpoints,
    fingerprint,
    first_loadable,
    locate,
    read_json,
    save_checkpoint,
    stamp_digits,
    torch_load,
)
from nanochat_ext.runtime.precision import precision
from nanochat_ext.tokenizer import TokenizerWrapper


class RewardModel(nn.Module):
    def __init__(self, backbone: Backbone):
        super().__init__()
        self.backbone = backbone
        # No bias: it cancels in r_chosen - r_rejected, so its gradient is rounding noise that Adam
        # would scale up into lr-sized drift.
        self.head = nn.Linear(backbone.hidden_size, 1, bias=False)

    def init_head(self, seed: int) -> None:
        """N(0, 1/hidden), drawn on CPU from `seed` and copied to the head's device: the same head for a seed
        on CPU and CUDA (a CPU generator cannot fill a CUDA tensor)."""
        g = torch.Generator().manual_seed(seed)
        draw = torch.empty(self.head.weight.shape).normal_(0.0, self.backbone.hidden_size ** -0.5, generator=g)
        with torch.no_grad():
            self.head.weight.copy_(draw)

    @property
    def backbone_frozen(self) -> bool:
        return not any(p.requires_grad for p in self.backbone.parameters())

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Rewards of right-padded rows, each read at a last real token. lengths (N,): one sequence per
        row, (N,) rewards. Or lengths (B, 1 + K): PrefixTree rows, a shared prefix then K branches (a
        pair's prompt, chosen and rejected, see collate_pairs): (K * B,) rewards, branch by branch
        (the B chosen, then the B rejected). No attention mask: attention is causal, so pads after that
        token cannot reach it."""
        frozen = contextlib.nullcontext() if not self.backbone_frozen else torch.no_grad()
        with frozen:  # the last block runs at the scored positions only
            if lengths.dim() == 2:
                last = self.backbone.branch_states(input_ids, lengths).transpose(0, 1).flatten(0, 1)
            else:
                last = self.backbone.hidden_states(input_ids, at=lengths - 1)
        return self.head(last.float()).squeeze(-1)


def trainable_state(model: RewardModel, weights: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The head plus every backbone tensor that trains (the frozen rest is reloaded from its source): the model's
    own, or those of `weights`, its state dict gathered whole from a sharded model."""
    names = [n for n, p in model.named_parameters() if p.requires_grad or n.startswith("head.")]
    own = dict(model.named_parameters()) if weights is None else weights
    return {n: own[n].detach().cpu().clone() for n in names}


class RewardScorer:
    """A trained reward model, ready to score (prompt, response) pairs in the precision it was trained
    in (dtype: its matmul dtype; bf16 means frozen weights in bf16 under bf16 autocast, as in training)."""

    def __init__(self, model: RewardModel, tokenizer: TokenizerWrapper, max_len: int, meta: dict,
                 dtype: torch.dtype = torch.float32, path: Path | None = None, pad_id: int | None = None):
        self.model, self.tokenizer, self.max_len, self.meta = model.eval(), tokenizer, max_len, meta
        self.dtype = dtype
        self.path = path  # the checkpoint file (or transformers dir) it was loaded from
        # A transformers classifier scores a sequence at its last token that is not its config's pad token: a
        # sequence ending in that token (a tokenizer that pads with EOS) is scored before it, as there.
        self.pad_id = pad_id

    @property
    def device(self) -> torch.device:
        return self.model.head.weight.device

    @torch.no_grad()
    def score(self, prompts: list[str | list[dict]], responses: list[str], batch_size: int = 32) -> list[float]:
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        seqs = []
        for prompt, response in zip(prompts, responses):
            msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            seqs.append(truncate(self.tokenizer.render_prompt(msgs), self.tokenizer.render_response(response),
                                 self.max_len, self.tokenizer.bos_id))
        return self.score_ids(seqs, batch_size)

    @torch.no_grad()
    def score_ids(self, seqs: list[list[int]], batch_size: int = 32, group: int = 1) -> list[float]:
        """Scores of token sequences, about batch_size at a time. group > 1: consecutive runs of that
        many sequences (a prompt's samples) are each one PrefixTree row, their common prefix computed
        once where that is cheaper; the same scores."""
        if group < 1 or len(seqs) % group:
            raise ValueError(f"{len(seqs)} sequences do not split into groups of {group}")
        if self.pad_id is not None:
            seqs = [trim_trailing(s, self.pad_id) for s in seqs]
        out: list[float] = []
        step = max(1, batch_size // group) * group
        for i in range(0, len(seqs), step):
            chunk = seqs[i:i + step]
            if group == 1:
                rows, lengths = chunk, torch.tensor([len(s) for s in chunk])
            else:
                rows, lengths = prefix_tree_rows([chunk[j:j + group] for j in range(0, len(chunk), group)])
                lengths = torch.tensor(lengths)
            with precision(self.dtype, self.device):
                scores = self.model(right_pad(rows, self.tokenizer.pad_id).to(self.device), lengths.to(self.device))
            out += scores.float().view(group, -1).T.flatten().tolist()  # branch-major to sequence order
        return out


def trim_trailing(seq: list[int], token: int) -> list[int]:
    end = len(seq)
    while end > 1 and seq[end - 1] == token:
        end -= 1
    return seq[:end]


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
    if not isinstance(meta, dict) or meta.get("kind") != RM_KIND:
        raise InputError(f"not a reward-model checkpoint (meta 'kind' is not {RM_KIND!r})", path=str(meta_path))
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
                 "backbone_ref": {"path": str(final_bb.resolve()),
                                  "relative_to_checkpoint": str(bb.relative_to(staging)),
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
        raise InputError("no bias-free `score` head of one output, as transformers' reward classifiers have",
                         path=str(d))
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
    meta = {"kind": RM_KIND, "format": "hf", "max_len": max_len, "architecture": architecture}
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
