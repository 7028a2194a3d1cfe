"""One interface over every model we train or score (loader.py builds them): nanochat checkpoints and Hugging Face
dirs of transformers' nanochat port on our GPT (gpt.py), Hugging Face dirs of the Llama family on our native Llama
(llama.py), which is much cheaper per call, any other HF architecture on transformers' own module. Hidden states,
logits, blocks, freezing, KV-cache decoding, save.
"""
from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
import torch.nn as nn

from nanochat_ext.errors import InputError
from nanochat_ext.models.attention import PrefixTree
from nanochat_ext.models.gpt import GPT
from nanochat_ext.models.heads import HeadTransform, probe
from nanochat_ext.models.llama import Llama
from nanochat_ext.runtime.checkpoint import save_checkpoint
from nanochat_ext.tokenizer import TokenizerWrapper


class Backbone(nn.Module):
    """A causal LM seen as: token ids -> final hidden states (B, T, H) -> logits.

    kind is the source format ("nanochat" or "hf"), which is also the format it saves in; native
    says whether the model is one of ours (GPT, Llama) or a transformers module.
    """
    adapters = None  # peft's PeftModel around self.model under --lora_r (lora.apply_lora), else None
    compiled: str | None = None  # torch.compile's backend for the blocks and the LM head (compiled.compile_blocks)

    def __init__(self, kind: str, model: nn.Module, source: str, hf_config=None,
                 source_meta: dict | None = None, source_dtypes: dict[str, torch.dtype] | None = None):
        super().__init__()
        self.kind, self.source = kind, source
        self.model = model
        self.hf_config = hf_config  # kept to save a native model of a Hugging Face dir back as one
        # A nanochat checkpoint is saved back in its own layout: its model_config verbatim, each
        # tensor in the dtype it came in (nanochat's GPU checkpoints keep embeddings in bf16).
        self.source_meta = source_meta or {}
        self.source_dtypes = source_dtypes or {}
        self.native = isinstance(model, (GPT, Llama))
        if self.native:
            self.hidden_size = model.config.n_embd if isinstance(model, GPT) else model.config.hidden_size
            self.vocab_size = model.config.vocab_size
            self.max_seq_len = model.max_seq_len
        else:
            self.hidden_size = model.config.hidden_size
            self.vocab_size = model.get_input_embeddings().num_embeddings
            self.max_seq_len = getattr(model.config, "max_position_embeddings", 1 << 30)
        # What the model's own forward does after its LM head (a cap, a scale), so logits from hidden states are its
        # own; a classifier (no output embeddings) never computes logits. A head we cannot reproduce is refused where
        # logits are asked for (head_transform), not here: a reward model reads hidden states only.
        self._head, self._head_refused = HeadTransform(), None
        if not self.native and model.get_output_embeddings() is not None:
            try:
                self._head = probe(model, source)
            except InputError as e:
                self._head_refused = e

    @property
    def head_transform(self) -> HeadTransform:
        """What logits() applies to the LM head's output; raises the refusal of a head it cannot reproduce (read it
        before training, as CompletionLogprobs does, to stop at start)."""
        if self._head_refused is not None:
            raise self._head_refused
        return self._head

    @property
    def vintage(self) -> str | None:
        """The nanochat vintage this backbone computes as (None for HF models)."""
        return self.model.config.vintage if isinstance(self.model, GPT) else None

    @property
    def blocks(self) -> nn.ModuleList:
        if self.native:
            return self.model.blocks
        base = self.model.base_model
        for name in ("layers", "h", "blocks"):
            if isinstance(getattr(base, name, None), nn.ModuleList):
                return getattr(base, name)
        raise InputError(f"cannot find the transformer blocks of {type(self.model).__name__}", path=self.source)

    def _final_norm(self) -> nn.Module | nn.Parameter | None:
        if isinstance(self.model, Llama):
            return self.model.norm
        return None if self.native else getattr(self.model.base_model, "norm", None)

    def set_trainable(self, unfreeze_last: int | str) -> None:
        """Freeze everything, then unfreeze the last N blocks (and a learned final norm), or 'all'."""
        if unfreeze_last == "all":
            self.requires_grad_(True)
            return
        self.requires_grad_(False)
        n = int(unfreeze_last)
        if n < 0 or n > len(self.blocks):
            raise InputError(f"--unfreeze_last must be 0..{len(self.blocks)} or 'all', got {n}")
        if n == 0:
            return
        for block in self.blocks[len(self.blocks) - n:]:
            block.requires_grad_(True)
        final_norm = self._final_norm()
        if final_norm is not None:
            final_norm.requires_grad_(True)

    def output_head_params(self) -> list[nn.Parameter]:
        """Parameters only logits() uses (an LM head not tied to the input embeddings). A reward model
        never calls logits(), so it freezes these: DDP refuses trainable parameters that get no grad."""
        if isinstance(self.model, GPT):
            return [self.model.lm_head.weight]
        if isinstance(self.model, Llama):
            return [] if self.model.lm_head is None else [self.model.lm_head.weight]
        out, inp = self.model.get_output_embeddings(), self.model.get_input_embeddings()
        return [] if out is None or out.weight is inp.weight else list(out.parameters())

    def hidden_states(self, input_ids: torch.Tensor, at: torch.Tensor | None = None,
                      tree: PrefixTree | None = None) -> torch.Tensor:
        """Final hidden states of right-padded rows (causal attention: pads cannot reach real tokens):
        (B, T, hidden), or with `at` (B,) only row b's at position at[b], (B, hidden). Our models then
        run the last block's queries and MLP at those positions alone. tree: prefix-tree rows (our
        models only; see PrefixTree)."""
        if self.native:
            return self.model.hidden_states(input_ids, at=at, tree=tree)
        if tree is not None:
            raise ValueError("prefix-tree rows need one of our models (nanochat GPT or native Llama)")
        hidden = self.model.base_model(input_ids=input_ids, use_cache=False).last_hidden_state
        return hidden if at is None else hidden[torch.arange(hidden.size(0), device=hidden.device), at]

    def shares_prefixes(self, lengths: torch.Tensor) -> bool:
        """Whether prefix-tree rows of these lengths run as trees (else as a row per branch)."""
        return self.native and PrefixTree.pays(lengths, self.hidden_size)

    def branch_states(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Final hidden states at the last token of each branch of prefix-tree rows (see PrefixTree;
        lengths (B, 1 + K): prefix, then branch lengths): (B, K, hidden). Our models run each row once,
        the prefix shared, where that is cheaper (PrefixTree.pays); otherwise, and for a transformers
        model, each prefix + branch runs as a row of its own."""
        if self.shares_prefixes(lengths):
            tree = PrefixTree.from_lengths(lengths, input_ids.device)
            return self.hidden_states(input_ids, at=tree.ends, tree=tree)
        rows, last = unshare_branches(input_ids, lengths)
        return self.hidden_states(rows, at=last).view(lengths.size(0), lengths.size(1) - 1, -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.native:
            return self.model.logits(hidden)
        return self.head_transform(self.model.get_output_embeddings()(hidden).float())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.logits(self.hidden_states(input_ids))

    # ---- incremental decoding (KV cache) ------------------------------------------------------------
    def prefill(self, input_ids: torch.Tensor, key_mask: torch.Tensor | None, max_len: int):
        """Run left-padded prompts (key_mask False on padding; None: no padding, native models only);
        return (last-position logits, cache)."""
        if self.native:
            cache = self.model.new_kv_cache(input_ids.size(0), max_len)
            return self.model.logits(self.model.hidden_states(input_ids, key_mask, cache)[:, -1]), cache
        from transformers import DynamicCache

        positions = (key_mask.long().cumsum(-1) - 1).clamp(min=0)  # real tokens count from 0
        out = self.model(input_ids=input_ids, attention_mask=key_mask.long(), position_ids=positions,
                         past_key_values=DynamicCache(), use_cache=True)
        return out.logits[:, -1].float(), out.past_key_values

    def decode(self, cache, tokens: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """Append one token per row (B,) to the cache; key_mask covers every cached position plus it."""
        if self.native:
            return self.model.logits(self.model.hidden_states(tokens[:, None], key_mask, cache)[:, -1])
        positions = key_mask.long().sum(-1, keepdim=True) - 1
        out = self.model(input_ids=tokens[:, None], attention_mask=key_mask.long(), position_ids=positions,
                         past_key_values=cache, use_cache=True)
        return out.logits[:, -1].float()

    def repeat_cache(self, cache, n: int) -> None:
        if self.native:
            cache.repeat_interleave(n)
        else:
            cache.batch_repeat_interleave(n)

    def select_cache(self, cache, rows: torch.Tensor) -> None:
        """Keep the cache's rows `rows` (a 1-d index) alone, in that order."""
        if self.native:
            cache.select_rows(rows)
        else:
            cache.batch_select_indices(rows)

    @torch.no_grad()
    def restore(self, train_state: dict, saved: Backbone | None = None) -> None:
        """For --resume: take a saved checkpoint's weights (if given), then the fp32 masters its
        train state holds where the layout stored a lower precision."""
        if saved is not None:
            for p, q in zip(self.parameters(), saved.parameters()):
                p.copy_(q)
        own = self.model.state_dict()
        for k, v in train_state.get("fp32_masters", {}).items():
            own[k].copy_(v)

    # ---- saving -------------------------------------------------------------------------------------
    def save(self, out_dir: str | os.PathLike, stamp: int, meta: dict, tokenizer: TokenizerWrapper,
             train_state: dict | None = None, weights: dict[str, torch.Tensor] | None = None,
             masters: bool = True) -> Path:
        """Rank 0: write the model so that load_backbone() takes it back: a nanochat checkpoint
        (model_<stamp>.pt + meta with model_config, tokenizer beside it) or an HF dir model_<stamp>/.
        weights: self.model's state dict gathered whole beforehand (a sharded model's, a LoRA model's merged), else
        its own. masters: keep in train_state the fp32 values the layout rounds (a full fine-tune resumes from them;
        a LoRA run resumes from its adapters instead)."""
        if self.kind == "nanochat":
            tokenizer.save(out_dir)
            config = self.source_meta.get("model_config") or self.model.config.nanochat_dict()
            meta = {**meta, "model_config": config, "nanochat_vintage": self.vintage}
            full = weights if weights is not None else {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
            state = {k: v.to(self.source_dtypes.get(k, v.dtype)) for k, v in full.items()}
            if train_state is not None and masters:  # a resumed run continues from the fp32 masters, not the bf16 copy
                train_state = {**train_state, "fp32_masters": {k: v for k, v in full.items()
                                                                if state[k].dtype != v.dtype}}
            return save_checkpoint(out_dir, stamp, state, meta, train_state)

        def write_dir(d: Path) -> None:
            if self.native:  # our Llama, or our GPT of transformers' nanochat port: saved in transformers' layout
                from safetensors.torch import save_file

                d.mkdir(parents=True)
                self.hf_config.save_pretrained(str(d))
                save_file(self.model.to_hf_state_dict(weights), str(d / "model.safetensors"),
                          metadata={"format": "pt"})
            else:
                self.model.save_pretrained(str(d), **({} if weights is None else {"state_dict": weights}))
            tokenizer.save(d)

        return save_checkpoint(out_dir, stamp, write_dir, meta, train_state)


def unshare_branches(input_ids: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefix-tree rows (B, T) as plain right-padded rows, prefix + branch k as row b * K + k:
    (B * K, T') ids and each row's last index (B * K,)."""
    lengths = lengths.cpu()
    B, K = lengths.size(0), lengths.size(1) - 1
    total = (lengths[:, :1] + lengths[:, 1:]).reshape(-1, 1)  # (B * K, 1): prefix + branch
    t = torch.arange(int(total.max())).expand(B * K, -1)
    index = tree_positions(t, lengths).masked_fill(t >= total, 0)
    rows = input_ids.gather(1, index.reshape(B, -1).to(input_ids.device)).view(B * K, -1)
    return rows, (total.view(-1) - 1).to(input_ids.device)


def tree_positions(index: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Positions `index` (B * K, L) in the sequences prefix + branch k of prefix-tree rows with these
    lengths (B, 1 + K), row b * K + k for branch k of tree row b, as indices into the tree rows: the
    prefix stays, a branch's tokens move to where the branch begins."""
    lengths = lengths.cpu()
    prefix = lengths[:, :1].repeat_interleave(lengths.size(1) - 1, 0).to(index.device)  # (B * K, 1)
    start = lengths.cumsum(-1)[:, :-1].reshape(-1, 1).to(index.device)  # where each branch begins
    return torch.where(index >= prefix, index - prefix + start, index)


def hold_frozen_in(module: nn.Module, dtype: torch.dtype, matmuls_only: bool = False) -> nn.Module:
    """Keep every parameter that does not train in the compute dtype (bf16 under bf16 autocast, a
    no-op in fp32). A frozen weight needs no fp32 master, and autocast would cast it to bf16 for every
    matmul anyway: the RM's frozen backbone, GRPO's reference and the eval models take half the memory.
    Trainable parameters keep their fp32 masters. Training and scoring an RM apply the same rule, so an
    RM scores exactly as it was validated.
    matmuls_only: only linear layers' weights and biases, which autocast casts anyway (not one tied to an
    embedding, which a lookup reads too). Embeddings, norms and scalars stay fp32 as the policy's masters do,
    so GRPO's reference computes bitwise as the policy it copies (with its embeddings in bf16, step 1 of a
    bf16 run measured a KL of up to 2e-6 between equal weights)."""
    params = matmul_params(module) if matmuls_only else list(module.parameters())
    for p in params:
        if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return module


def shared_copy(model: nn.Module, own: dict[int, torch.Tensor] | None = None) -> nn.Module:
    """A copy of model (in eval mode) sharing every parameter and buffer but those in `own` (by id: the copy's tensor
    for that one), running its own modules: a forward set on an instance (--compile's, activation checkpointing's)
    calls the original module's, and is dropped from the copy."""
    memo = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    memo.update(own or {})
    made = copy.deepcopy(model, memo=memo)
    for m in made.modules():
        if getattr(m.__dict__.get("forward"), "wraps_block", False):
            del m.forward
    return made.eval()


def matmul_params(module: nn.Module) -> list[nn.Parameter]:
    """The weights and biases of module's linear layers, which autocast casts to its dtype at every matmul, less
    any also held by another kind of module (an embedding tied to the LM head, which a lookup reads too)."""
    def owned(linear: bool) -> list[nn.Parameter]:
        return [p for m in module.modules() if isinstance(m, nn.Linear) == linear for p in m.parameters(recurse=False)]

    elsewhere = {id(p) for p in owned(linear=False)}
    return [p for p in owned(linear=True) if id(p) not in elsewhere]


