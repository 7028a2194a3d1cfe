"""A GGUF file (llama.cpp's format: weights, config and tokenizer in one file, often quantized) made into a Hugging
Face dir every stage loads: fp32 safetensors, config.json, the tokenizer with its chat template,
generation_config.json.

transformers reads the GGUF (dequantizing it, undoing llama.cpp's q/k row order, building the tokenizer from its
metadata) and is the oracle the conversion is checked against: before the dir is published, the dir is loaded
through our own loader (load_backbone: the Llama family on our native Llama) and its logits on a few ragged rows must
match transformers' GGUF-loaded model, and our tokenizer must render the same chat prompts to the same ids as the
GGUF's. The dir is written under <out>.tmp and renamed into place only when both hold, with MARKER the last file in
it: a dir with MARKER is a complete, checked conversion (converted.is_converted).
"""
from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from nanochat_ext.errors import InputError, from_outside
from nanochat_ext.models.converted import MARKER
from nanochat_ext.models.loader import load_backbone, quiet_transformers
from nanochat_ext.tokenizer import TokenizerWrapper

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

GGUF_PACKAGE = "gguf==0.19.0"  # the version requirements.txt pins

# Both sides compute in fp32 with the same weights; only the kernels and the order of the sums differ (our fused
# q/k/v and gate/up projections, our attention), so rounding (~1e-7 relative per op) grows over the layers to about
# 1e-6..1e-5 of the logits' scale (SmolLM2-135M: 0 batched, 6e-5 absolute of 34 row by row). A wrong conversion (a
# tensor transposed or from another layer, q/k rows in llama.cpp's order, a norm lost, an untied head tied) moves
# logits by a good fraction of their scale. 1e-4 of the largest |logit| sits orders of magnitude from both.
LOGIT_TOLERANCE = 1e-4

# The rows the check runs: chat prompts of different lengths (a system turn, a multi-turn one), right-padded.
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Name a prime number larger than ten, please."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "Tell me a short joke about cats and numbers."}],
]


def require_gguf_package() -> None:
    """transformers reads GGUF files through the gguf package: one line saying how to install it."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise InputError(f"reading a GGUF file needs the gguf package: pip install {GGUF_PACKAGE}") from None


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Convert the GGUF file into a Hugging Face dir at out_dir (new or empty), checked against transformers'
    reading of the GGUF (logits through our loader, chat-prompt ids through our tokenizer) before it is renamed into
    place; on any failure nothing is left at out_dir. Returns out_dir."""
    src, out = Path(gguf_path), Path(out_dir)
    if not src.is_file():
        raise InputError("GGUF file does not exist", path=str(src))
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError("out dir exists and is not empty: remove it to convert again", path=str(out))
    require_gguf_package()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    with from_outside("GGUF file", src):
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                          dtype=torch.float32).eval()
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        write_hf_dir(gguf_model, tok, staging)
        prompts = check_tokenizer(tok, staging, src)
        # padded as our tokenizer pads (check_tokenizer's wrapper refused a tokenizer with neither id)
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        measured = check_logits(gguf_model, staging, prompts, pad_id, src)
        record = {"gguf": str(src.resolve()), "gguf_bytes": src.stat().st_size, "gguf_sha256": sha256(src),
                  **measured, "transformers": importlib.metadata.version("transformers"),
                  "gguf_package": importlib.metadata.version("gguf")}
        (staging / MARKER).write_text(json.dumps(record, indent=1) + "\n")
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def plain_weights(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The GGUF-loaded model's weights as plain fp32 tensors (transformers dequantized them on reading)."""
    return {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}


def write_hf_dir(gguf_model: PreTrainedModel, tok: PreTrainedTokenizerBase, staging: Path) -> None:
    """Save the GGUF-loaded model as a plain fp32 Hugging Face dir. transformers refuses save_pretrained on a
    GGUF-loaded model, so its weights go into a fresh model of the same config, less the quantization_config that
    would make every later load read them as GGUF again."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(gguf_model.config)
    config.__dict__.pop("quantization_config", None)
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(plain_weights(gguf_model))
    fresh.generation_config = copy.deepcopy(gguf_model.generation_config)
    fresh.save_pretrained(str(staging), safe_serialization=True)
    tok.save_pretrained(str(staging))


def check_tokenizer(tok: PreTrainedTokenizerBase, staging: Path, src: Path) -> list[list[int]]:
    """Our tokenizer on the converted dir renders CONVERSATIONS' prompts to the ids the GGUF's own tokenizer gives
    (through its chat template; without one, the plain texts): one line naming the GGUF otherwise. Returns those
    ids (the logit check's rows)."""
    ours = TokenizerWrapper.load(staging, model_dir=staging)
    rows = []
    for conversation in CONVERSATIONS:
        if tok.chat_template:
            want = list(tok.apply_chat_template(conversation, add_generation_prompt=True)["input_ids"])
            got = ours.render_prompt(conversation)
        else:
            text = "\n\n".join(m["content"] for m in conversation)
            want, got = tok.encode(text, add_special_tokens=False), ours.encode(text)
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise InputError(f"the converted tokenizer renders a chat prompt to other ids than the GGUF's own "
                             f"(first difference at token {at} of {len(want)}); nothing was written", path=str(src))
        rows.append(want)
    if tok.eos_token_id is not None and tok.eos_token_id not in ours.stop_ids:
        raise InputError(f"the converted tokenizer does not stop at the GGUF's eos id {tok.eos_token_id}",
                         path=str(src))
    return rows


def check_logits(gguf_model: PreTrainedModel, staging: Path, prompts: list[list[int]], pad_id: int,
                 src: Path) -> dict[str, float]:
    """Our loader's logits on the converted dir against transformers' GGUF-loaded model, on the prompts as one
    right-padded batch (as our Backbone takes rows; transformers with the attention mask), at every real token:
    within LOGIT_TOLERANCE of the logits' scale, else one line naming the GGUF. Returns what was measured."""
    ours = load_backbone(staging)
    prompts = [p[:ours.max_seq_len] for p in prompts]  # a model of a short context: its first positions
    lengths = torch.tensor([len(p) for p in prompts])
    ids = torch.full((len(prompts), int(lengths.max())), pad_id, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, :len(p)] = torch.tensor(p)
    real = torch.arange(ids.size(1))[None] < lengths[:, None]
    with torch.no_grad():
        want = gguf_model(input_ids=ids, attention_mask=real.long()).logits.float()[real]
        got = ours(ids)[real]
    scale = float(want.abs().max())
    diff = float((got - want).abs().max())
    bound = LOGIT_TOLERANCE * scale
    if not diff <= bound:  # a NaN is refused too
        raise InputError(f"the converted model's logits differ from transformers' reading of the GGUF by up to "
                         f"{diff:.3g}, more than {bound:.3g} ({LOGIT_TOLERANCE:g} x the largest |logit|, {scale:.3g}): "
                         f"the conversion is wrong; nothing was written", path=str(src))
    return {"max_logit_diff": diff, "logit_scale": scale, "logit_tolerance": bound,
            "checked_tokens": int(real.sum()), "checked_on": "native" if ours.native else "transformers"}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
