"""A policy in training, what the GRPO and DPO trainers share before their loops: the policy loaded with its
tokenizer and LoRA adapters and held in the compute dtype, its frozen reference (a loaded copy computing as the
policy does, or the policy itself with its adapters off), compiled and wrapped for DDP or FSDP, its optimizer; its
checkpoints (a nanochat checkpoint or a Hugging Face dir that loads again as --policy, or its adapters) and resuming
from them.
"""
from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch

from nanochat_ext.ddp_common import DistEnv, compute_dtype, precision, print0
from nanochat_ext.errors import InputError
from nanochat_ext.models.backbone import hold_frozen_in
from nanochat_ext.models.compiled import compile_models
from nanochat_ext.models.loader import load_backbone, load_tokenizer_for, merged_weights
from nanochat_ext.models.lora import (LoraSpec, WithoutAdapters, adapter_state, apply_lora, describe as describe_lora,
                                      load_adapter_state, merge_now, save_adapters)
from nanochat_ext.runtime.checkpoint import fingerprint, portable_paths, save_checkpoint
from nanochat_ext.runtime.parallel import Parallel, checkpoint_activations
from nanochat_ext.training.logprobs import CompletionLogprobs, reference_model
from nanochat_ext.training.optim import check_muon_model, make_optimizer
from nanochat_ext.training.trainer import Saving, Trainer


class PolicyTraining:
    """The policy of `args.policy` (with args.tokenizer, args.nanochat_vintage, args.dtype, args.parallel,
    args.compile, args.activation_checkpointing, args.optimizer, args.lr, args.weight_decay), set up in three
    steps around what a trainer does between them: the constructor loads it (and adds adapters), build() makes
    its reference and its log-prob model, wrap() shards or replicates it and makes the optimizer.
    `state`: what a checkpoint's resume state holds beyond the Trainer's; the script keeps it current from before
    anything can save (--consolidate, a resumed run with no step left) to the loop's every step. The reference is
    the policy as it starts, or args.reference where a trainer has that flag (DPO: another checkpoint of the same
    architecture, such as the SFT model the policy came from)."""

    def __init__(self, args: argparse.Namespace, env: DistEnv, lora: LoraSpec | None):
        self.args, self.env, self.lora = args, env, lora
        self.policy = load_backbone(args.policy, env.device, vintage=args.nanochat_vintage)
        check_muon_model(args.optimizer, self.policy.model)
        self.tok = load_tokenizer_for(self.policy, args.tokenizer)
        self.other_reference = None  # args.reference, loaded and checked before anything is written
        self.reference_print = None  # its fingerprint: a resumed run must read the same reference
        if getattr(args, "reference", None):
            self.other_reference = load_backbone(args.reference, env.device, vintage=args.nanochat_vintage)
            want, got = parameter_shapes(self.policy.model), parameter_shapes(self.other_reference.model)
            if got != want:
                raise InputError(f"--reference is not --policy's architecture: {describe_difference(want, got)}",
                                 path=args.reference)
            self.reference_print = fingerprint(args.reference)
        if lora:  # before anything is written: peft refuses targets it cannot find
            apply_lora(self.policy, lora)
        self.state: dict = {}
        self.resume_path: Path | None = None
        self.reference: torch.nn.Module | None = None  # build() makes it and the model, wrap() the rest

    def build(self, reference: bool, temperature: float = 1.0, also_compile: tuple = ()) -> CompletionLogprobs:
        """Hold the policy in the compute dtype (a LoRA base as the reference would be), make its frozen
        reference if asked (self.reference, else None), compile them (and `also_compile`'s backbones), and return
        the module DDP or FSDP wraps: the policy's completion log-probs at `temperature`."""
        args, env, policy = self.args, self.env, self.policy
        self.dtype = compute_dtype(args.dtype, env.device)
        self.autocast = precision(self.dtype, env.device)
        if self.lora:  # the adapters train; the frozen base's matmul weights are held as the reference's would be
            hold_frozen_in(policy, self.dtype, matmuls_only=True)
            print0(describe_lora(policy))
        else:
            policy.set_trainable("all")
        self.parallel = Parallel(args.parallel, env, self.dtype)
        other, self.other_reference = self.other_reference, None  # held by the reference alone, which may be freed
        if reference and (other or not self.lora):  # computes as the policy does (under fsdp on CUDA in bf16)
            backbone = other or load_backbone(args.policy, env.device, vintage=args.nanochat_vintage)
            self.reference = reference_model(backbone, self.dtype, temperature=temperature,
                                             matmuls_only=self.parallel.gathers_in is None)
        print0(compile_models(args.compile, env.device, policy, self.reference.backbone if self.reference else None,
                              *also_compile))
        if args.activation_checkpointing:
            checkpoint_activations(policy.blocks)
        self.model = CompletionLogprobs(policy, temperature=temperature)
        if reference and self.lora and not other:  # the policy itself with its adapters off: no second copy
            self.reference = WithoutAdapters(self.model, policy)
        return self.model

    def wrap(self) -> None:
        """DDP or FSDP around the log-prob model (self.ddp_model), then the optimizer over what trains."""
        self.ddp_model = self.parallel.wrap(self.model, self.policy.blocks)
        print0(self.parallel.describe(self.model))
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]  # after wrapping: FSDP's own
        self.optimizer = make_optimizer(self.args.optimizer, self.policy.model, self.trainable, self.args.lr,
                                        self.args.weight_decay, self.env.device)
        self.source_print = fingerprint(self.policy.source)  # a resumed run must start from the same weights

    def describe(self) -> str:
        """The model line: the policy, what trains, and where its reference comes from."""
        ref = ("off" if self.reference is None else "the base, adapters off"
               if isinstance(self.reference, WithoutAdapters) else "loaded")
        return (f"model: {self.policy.kind} policy {self.policy.source}, {sum(p.numel() for p in self.trainable):,} "
                f"params; reference {ref}" + (" (the reference and any reward model are held whole on every rank)"
                                              if self.parallel.sharded else ""))

    def saving(self, step: int, into: Path, consolidate: bool) -> Saving:
        """The checkpoint of `step` (Trainer's saving): the policy in its own layout, its adapters, or (--merge_lora)
        the base with them merged."""
        lora, policy = self.lora, self.policy
        merge = merge_now(self.args, step, consolidate)
        base = lora and {**portable_paths(policy.source, into), "fingerprint": self.source_print,
                         "vintage": policy.vintage}
        meta = {"source_policy": str(Path(policy.source).resolve()), "source_fingerprint": self.source_print,
                "lora": lora and {**lora.to_meta(), "base": base, "merged": merge}}
        return Saving(meta, functools.partial(self.write_whole, merge=merge, base=base),
                      {**self.state, "source_fingerprint": self.source_print,
                       **({"reference_fingerprint": self.reference_print} if self.reference_print else {})})

    def write_whole(self, d: Path, stamp: int, meta: dict, state: dict | None, weights: dict | None, *,
                    merge: bool, base: dict | None) -> Path:
        """Rank 0: the whole policy into d (Saving.write_whole)."""
        policy, tok = self.policy, self.tok
        if not self.lora:
            return policy.save(d, stamp, meta, tok, state, weights)
        state = state and {**state, "adapters": adapter_state(policy)}
        if merge:  # the base with the adapters merged, in its own layout
            return policy.save(d, stamp, meta, tok, state, merged_weights(policy), masters=False)
        return save_checkpoint(d, stamp, lambda tmp: save_adapters(policy, tmp, tok, base), meta, state)

    def load_whole(self, state: dict) -> None:
        """A whole checkpoint's weights back (Trainer.resume): the adapters from its state, or the policy's own."""
        if self.lora:  # the base is the input's; the resume state holds the adapters
            load_adapter_state(self.policy, state["adapters"], self.resume_path)
        else:
            self.policy.restore(state, saved=load_backbone(self.resume_path, self.env.device))

    def trainer(self, out_dir: Path, kind: str, resume: tuple | None, flags: tuple[str, ...],
                absent: dict) -> Trainer:
        """Collective: the Trainer of this policy, resumed from `resume` (resolve_resume's) where given: refused when
        --policy's weights are not the ones the run started from."""
        trainer = Trainer(self.args, self.env, self.parallel, self.model, self.optimizer, module=self.policy.model,
                          kind=kind, out_dir=out_dir, saving=self.saving)
        if resume is not None:
            if resume[2].get("source_fingerprint", self.source_print) != self.source_print:
                raise InputError(f"--policy {self.policy.source} is not the policy this run started from: its weights "
                                 f"changed since (fingerprint); resume with the original policy or start a new --out",
                                 path=str(resume[0]))
            if resume[2].get("reference_fingerprint") != self.reference_print:
                raise InputError(f"--reference {self.args.reference} is not the reference this run started from: its "
                                 f"weights changed since (fingerprint); resume with the original or start a new --out",
                                 path=str(resume[0]))
            self.resume_path = resume[0]
            trainer.resume(resume, flags, self.load_whole, absent=absent)
        return trainer


def parameter_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def describe_difference(want: dict[str, tuple[int, ...]], got: dict[str, tuple[int, ...]]) -> str:
    """The first parameter where two models' shapes differ, in words."""
    name = sorted(set(want) ^ set(got) or {n for n in want if want[n] != got[n]})[0]
    if name not in got:
        return f"it has no parameter {name}"
    if name not in want:
        return f"it has a parameter {name} the policy has not"
    return f"its {name} is {list(got[name])}, the policy's {list(want[name])}"
