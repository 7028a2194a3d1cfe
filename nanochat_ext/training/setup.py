"""A model in training, made ready in one call, what every trainer does before its loop: the model loaded and checked
before anything is written (load_policy, load_rm_backbone), then held in its compute dtype, compiled, wrapped for DDP
or FSDP with its optimizer, and resumed where a run continues (PolicyTraining for SFT, DPO and GRPO; RewardModelTraining
for the RM). What they do alike once built, saving in the input's own layout and resuming, is ModelTraining's.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from nanochat_ext.config import TrainerSpec, option
from nanochat_ext.ddp_common import DistEnv, print0
from nanochat_ext.errors import InputError
from nanochat_ext.models.backbone import Backbone, hold_frozen_in
from nanochat_ext.models.compiled import COMPILE_HELP, compile_models
from nanochat_ext.models.loader import RM_KIND, load_backbone, load_tokenizer_for, merged_weights
from nanochat_ext.models.lora import (
    LoraSpec,
    WithoutAdapters,
    adapter_state,
    apply_lora,
    load_adapter_state,
    save_adapters,
)
from nanochat_ext.models.lora import describe as describe_lora
from nanochat_ext.models.reward_model import RewardModel, trainable_state
from nanochat_ext.models.vintages import NANOCHAT_WRITTEN
from nanochat_ext.runtime.checkpoint import fingerprint, portable_paths, save_checkpoint, torch_load
from nanochat_ext.runtime.oom import FEWER_RANKS_STATE, LORA_STATE, smaller_micro
from nanochat_ext.runtime.parallel import PARALLEL_MODES, Parallel, checkpoint_activations
from nanochat_ext.runtime.precision import DTYPES, compute_dtype, precision
from nanochat_ext.runtime.resume import check_resume_args
from nanochat_ext.tokenizer import TokenizerWrapper, same_ids
from nanochat_ext.training.logprobs import CompletionLogprobs, reference_model
from nanochat_ext.training.optim import OptimConfig, check_muon_model, lr_warning, make_optimizer


@dataclass(frozen=True)
class ModelConfig:
    """How the trained model is read and computes, and how it spreads over the ranks."""
    tokenizer: str | None = option(None, "tokenizer dir (tokenizer.pkl or tokenizer.json); default: found beside the "
                                         "{model}, else $NANOCHAT_BASE_DIR/tokenizer")
    nanochat_vintage: str | None = option(None, "which nanochat wrote the checkpoint, when its keys cannot tell (only "
                                                "the softcap-20 week of March 2026 needs it: feb2026 vs mar2026a); "
                                                "default: read from the checkpoint", choices=NANOCHAT_WRITTEN)
    dtype: str = option("auto", "auto: bf16 autocast on CUDA, fp32 on CPU", choices=DTYPES)
    compile: str = option("auto", COMPILE_HELP, choices=("auto", "0", "1"))
    parallel: str = option("ddp", "ddp: every rank holds the whole trained model, gradients and optimizer state; fsdp: "
                                  "each rank holds 1/N of them (PyTorch FSDP2), checkpoints while training are sharded "
                                  "and the final one is also written whole (one rank under torchrun is fine)",
                           choices=PARALLEL_MODES)
    activation_checkpointing: bool = option(False, "keep only each transformer block's input for the backward pass and "
                                                   "recompute the rest there: less memory for about one more forward "
                                                   "pass, the same gradients", action="store_true")


@dataclass(frozen=True)
class Checks:
    """What a resumed run must keep (resume.check_resume_args): this run's flags as it records them, the keys that
    must match the checkpoint's, and the value a key had before checkpoints recorded it."""
    flags: dict
    keys: tuple[str, ...]
    absent: dict


class ModelTraining:
    """A built model in training: the module DDP or FSDP wraps (`model`; `ddp_model` the wrapped one), what trains
    and its optimizer, its compute dtype and autocast, the step it starts at (`start_step`: a resumed run's), its
    checkpoints. A subclass builds the model and says how it is written and read whole."""
    kind: str  # the checkpoint's meta 'kind'
    state_hints: tuple[str, ...]  # what takes less memory for its trained state (the out-of-memory line)

    def _start(self, env: DistEnv, cfg: ModelConfig) -> None:
        self.env, self.cfg = env, cfg
        self.dtype = compute_dtype(cfg.dtype, env.device)
        self.autocast = precision(self.dtype, env.device)
        self.parallel = Parallel(cfg.parallel, env, self.dtype)

    def _wrap(self, model: nn.Module, blocks: nn.ModuleList, module: nn.Module, optim: OptimConfig,
              base: nn.Module) -> None:
        """DDP or FSDP around `model`, then the optimizer over what trains (`base`: the model nanochat's optimizer
        groups read). `module`: the part whose layout a whole checkpoint is written in."""
        self.model, self.module = model, module
        self.ddp_model = self.parallel.wrap(model, blocks)
        print0(self.parallel.describe(model))
        self.trainable = [p for p in model.parameters() if p.requires_grad]  # after wrapping: FSDP's own
        self.optimizer = make_optimizer(optim.optimizer, base, self.trainable, optim.lr, optim.weight_decay,
                                        self.env.device)
        # this run's --lr per group, before a resumed optimizer state brings the saved run's (--resume_extend)
        self.base_lrs = [g.get("initial_lr", g["lr"]) for g in self.optimizer.param_groups]
        self.start_step, self.train_time, self.resumed = 0, 0.0, {}
        self.resumed_from: Path | None = None  # the checkpoint resumed, if any

    def _resume(self, resume: tuple | None, checks: Checks) -> None:
        """Collective: continue from `resume` (resolve_resume's choice; None: from scratch) if this run's flags are the
        ones it was trained with; shards load into the model and optimizer, a whole checkpoint's weights through
        load_whole."""
        if resume is None:
            return
        path, _, state = resume
        check_resume_args(state["args"], checks.flags, checks.keys, path, checks.absent)
        if not self.parallel.resume(path, self.model, self.optimizer):
            self.load_whole(state, path)
            self.optimizer.load_state_dict(state["optimizer"])
        self.start_step, self.train_time = int(state["step"]), float(state.get("train_time_s", 0.0))
        self.resumed, self.resumed_from = state, Path(path)
        print0(f"resume: from {path} at step {self.start_step}" + (f" (draw {state['draw']})" if "draw" in state
                                                                    else ""))

    def fresh_autocast(self) -> contextlib.AbstractContextManager:
        """The run's autocast as a new context (one in use in another thread is not entered twice)."""
        return precision(self.dtype, self.env.device)

    def training_hints(self, micro: int, share: int) -> tuple[str, ...]:
        """What takes less memory in a training micro-batch of `micro` of this rank's `share` rows."""
        return (*smaller_micro(micro, share), "--activation_checkpointing", *self.state_hints)

    def save(self, step: int, into: Path, *, final: bool, consolidate: bool, meta: dict, state: dict) -> Path:
        """Collective: the checkpoint of `step` into `into`, its meta (kind, stamp and step first, then the model's
        own fields and `meta`) and its resume state (`state`, and the model's own); its path on every rank."""
        merge = consolidate or (self.merge_lora and final)
        return self.parallel.save(
            into, self.model, self.optimizer, module=self.module, final=final, consolidate=consolidate,
            meta={"kind": self.kind, "step": step, **self.own_meta(into, merge), **meta},
            state={"step": step, **state, **self.own_state()},
            write_whole=functools.partial(self.write_whole, merge=merge))

    # What a subclass says of its checkpoints.
    merge_lora = False

    def own_meta(self, into: Path, merge: bool) -> dict:
        raise NotImplementedError

    def own_state(self) -> dict:
        return {}

    def write_whole(self, d: Path, stamp: int, meta: dict, state: dict | None, weights: dict | None, *,
                    merge: bool) -> Path:
        raise NotImplementedError

    def load_whole(self, state: dict, path: Path) -> None:
        raise NotImplementedError


@dataclass
class LoadedPolicy:
    """A policy read and checked before anything is written: its backbone (LoRA adapters on it where asked), its
    tokenizer, and the other checkpoint its reference is where one was given (of the same architecture)."""
    backbone: Backbone
    tok: TokenizerWrapper
    lora: LoraSpec | None
    reference: Backbone | None = None
    reference_path: str | None = None  # --reference as given
    reference_print: str | None = None  # its fingerprint: a resumed run must read the same reference


def load_policy(path: str, cfg: ModelConfig, env: DistEnv, lora: LoraSpec | None, optimizer: str = "adamw",
                reference: str | None = None) -> LoadedPolicy:
    """The policy at `path` (and the reference at `reference`), checked: one line for a model --optimizer cannot
    train, a reference of another architecture, adapters peft cannot place."""
    policy = load_backbone(path, env.device, vintage=cfg.nanochat_vintage)
    check_muon_model(optimizer, policy.model)
    tok = load_tokenizer_for(policy, cfg.tokenizer)
    other, other_print = None, None
    if reference:
        other = load_backbone(reference, env.device, vintage=cfg.nanochat_vintage)
        want, got = parameter_shapes(policy.model), parameter_shapes(other.model)
        if got != want:
            raise InputError(f"--reference is not --policy's architecture: {describe_difference(want, got)}",
                             path=reference)
        other_print = fingerprint(reference)
    if lora:  # before anything is written: peft refuses targets it cannot find
        apply_lora(policy, lora)
    return LoadedPolicy(policy, tok, lora, other, reference, other_print)


def load_teacher(path: str, tok: TokenizerWrapper, env: DistEnv) -> Backbone:
    """--teacher: a frozen model of any size and architecture that speaks the policy's tokenizer (it scores the
    policy's token ids), loaded whole on every rank. Refused: fewer ids than the policy's tokenizer has, or a tokenizer
    of its own (where one is beside it) that gives other ids."""
    teacher = load_backbone(path, env.device)
    why = None
    if teacher.vocab_size < tok.vocab_size:
        why = f"the teacher's vocabulary has {teacher.vocab_size} ids, the policy's tokenizer {tok.vocab_size}"
    else:
        try:
            own = load_tokenizer_for(teacher, None)
        except InputError:  # a nanochat checkpoint without its tokenizer beside it: its ids' count is what it says
            own = None
        if own is not None and not same_ids(own, tok):
            why = f"the teacher's tokenizer ({own.source}) gives other ids than the policy's ({tok.source})"
    if why:
        raise InputError(f"{why}: the teacher scores the policy's tokens, so both need one tokenizer", path=path)
    return teacher


class PolicyTraining(ModelTraining):
    """The policy in training (SFT, DPO, GRPO), ready: held in the compute dtype (a LoRA base as the reference would
    be), its frozen reference where asked (a loaded copy computing as the policy does, or the policy itself with its
    adapters off; `reference`: None without one), compiled, wrapped, its optimizer, resumed. `model` is the policy's
    completion log-probs at `temperature`. from_whole: what a method builds from the whole policy before it is
    sharded (GRPO: its rollout engines), called with the policy and the dtype a whole copy is kept in under a sharded
    --parallel (None otherwise); its result is `made_from_whole`."""
    state_hints = (FEWER_RANKS_STATE, LORA_STATE)

    def __init__(self, loaded: LoadedPolicy, cfg: ModelConfig, optim: OptimConfig, env: DistEnv, *, spec: TrainerSpec,
                 reference: bool, resume: tuple | None, checks: Checks, merge_lora: bool = False,
                 temperature: float = 1.0, also_compile: tuple = (),
                 from_whole: Callable[[Backbone, torch.dtype | None], object] | None = None):
        self._start(env, cfg)
        self.kind, self.merge_lora = spec.kind, merge_lora
        self.policy, self.tok, self.lora = loaded.backbone, loaded.tok, loaded.lora
        policy, lora = self.policy, self.lora
        self.reference_path, self.reference_print = loaded.reference_path, loaded.reference_print
        if lora:  # the adapters train; the frozen base's matmul weights are held as the reference's would be
            hold_frozen_in(policy, self.dtype, matmuls_only=True)
            print0(describe_lora(policy))
        else:
            policy.set_trainable("all")
        if warning := lr_warning(spec.name, spec.lr_cliff, optim, sum(p.numel() for p in policy.parameters()),
                                 bool(lora)):
            print0(warning)
        self.reference = None
        if reference and (loaded.reference or not lora):  # computes as the policy does (under fsdp on CUDA in bf16)
            backbone = loaded.reference or load_backbone(policy.source, env.device, vintage=cfg.nanochat_vintage)
            self.reference = reference_model(backbone, self.dtype, temperature=temperature,
                                             matmuls_only=self.parallel.gathers_in is None)
        print0(compile_models(cfg.compile, env.device, policy, self.reference.backbone if self.reference else None,
                              *also_compile))
        if cfg.activation_checkpointing:
            checkpoint_activations(policy.blocks)
        model = CompletionLogprobs(policy, temperature=temperature)
        if reference and lora and not loaded.reference:  # the policy itself with its adapters off: no second copy
            self.reference = WithoutAdapters(model, policy)
        whole_in = (self.parallel.gathers_in or torch.float32) if self.parallel.sharded else None
        # before the policy is sharded; its type is the method's (GRPO: rollouts.RolloutEngines)
        self.made_from_whole = from_whole(policy, whole_in) if from_whole else None
        self._wrap(model, policy.blocks, policy.model, optim, policy.model)
        self.source_print = fingerprint(policy.source)  # a resumed run must start from the same weights
        self._check_sources(resume)
        self._resume(resume, checks)

    def _check_sources(self, resume: tuple | None) -> None:
        """Refused: resuming from other --policy weights, or another --reference, than the run started from."""
        if resume is None:
            return
        if resume[2].get("source_fingerprint", self.source_print) != self.source_print:
            raise InputError(f"--policy {self.policy.source} is not the policy this run started from: its weights "
                             f"changed since (fingerprint); resume with the original policy or start a new --out",
                             path=str(resume[0]))
        if resume[2].get("reference_fingerprint") != self.reference_print:
            raise InputError(f"--reference {self.reference_path} is not the reference this run started from: its "
                             f"weights changed since (fingerprint); resume with the original or start a new --out",
                             path=str(resume[0]))

    def drop_reference(self) -> None:
        """Free the reference once nothing reads it (DPO's log-probs computed before training)."""
        self.reference = None

    def describe(self) -> str:
        """The model line: the policy, what trains, and where its reference comes from."""
        ref = ("off" if self.reference is None else "the base, adapters off"
               if isinstance(self.reference, WithoutAdapters) else "loaded")
        return (f"model: {self.policy.kind} policy {self.policy.source}, {sum(p.numel() for p in self.trainable):,} "
                f"params; reference {ref}" + (" (the reference and any reward model are held whole on every rank)"
                                              if self.parallel.sharded else ""))

    def own_meta(self, into: Path, merge: bool) -> dict:
        """The policy's source, and its adapters' settings and base (for a LoRA run)."""
        policy, lora = self.policy, self.lora
        base = lora and {**portable_paths(policy.source, into), "fingerprint": self.source_print,
                         "vintage": policy.vintage}
        return {"source_policy": str(Path(policy.source).resolve()), "source_fingerprint": self.source_print,
                "lora": lora and {**lora.to_meta(), "base": base, "merged": merge}}

    def own_state(self) -> dict:
        return {"source_fingerprint": self.source_print,
                **({"reference_fingerprint": self.reference_print} if self.reference_print else {})}

    def write_whole(self, d: Path, stamp: int, meta: dict, state: dict | None, weights: dict | None, *,
                    merge: bool) -> Path:
        """Rank 0: the whole policy into d in its own layout, its adapters, or (merge) the base with them merged."""
        policy, tok = self.policy, self.tok
        if not self.lora:
            return policy.save(d, stamp, meta, tok, state, weights)
        state = state and {**state, "adapters": adapter_state(policy)}
        if merge:
            return policy.save(d, stamp, meta, tok, state, merged_weights(policy), masters=False)
        return save_checkpoint(d, stamp, lambda tmp: save_adapters(policy, tmp, tok, meta["lora"]["base"]), meta, state)

    def load_whole(self, state: dict, path: Path) -> None:
        """A whole checkpoint's weights back: the adapters from its state, or the policy's own."""
        if self.lora:  # the base is the input's; the resume state holds the adapters
            load_adapter_state(self.policy, state["adapters"], path)
        else:
            self.policy.restore(state, saved=load_backbone(path, self.env.device))


def load_rm_backbone(path: str, cfg: ModelConfig, env: DistEnv, unfreeze_last: str,
                     lora: LoraSpec | None) -> tuple[Backbone, TokenizerWrapper]:
    """The RM's backbone and tokenizer, checked before anything is written: its last `unfreeze_last` blocks to train
    (or its LoRA adapters), never its LM head, which an RM does not read."""
    if lora and unfreeze_last != "0":
        raise InputError("--unfreeze_last trains whole blocks and --lora_r adapters on every block: give one of them")
    backbone = load_backbone(path, env.device, vintage=cfg.nanochat_vintage)
    tokenizer = load_tokenizer_for(backbone, cfg.tokenizer)
    backbone.set_trainable(unfreeze_last)
    for p in backbone.output_head_params():  # the RM reads hidden states; the LM head gets no gradient
        p.requires_grad_(False)
    if lora:  # before anything is written: peft refuses targets it cannot find
        apply_lora(backbone, lora)
        if any("lm_head" in n for n, p in backbone.named_parameters() if p.requires_grad):
            raise InputError("--lora_targets: an RM reads hidden states and never the LM head (lm_head): leave it out")
    return backbone, tokenizer


class RewardModelTraining(ModelTraining):
    """The reward model in training, ready: its frozen part held in the compute dtype, its head drawn from `seed`,
    compiled, wrapped, its optimizer (AdamW), resumed. `model` is the RewardModel; its checkpoint holds the head and
    what else trains, its meta where the backbone and tokenizer are (and their fingerprint)."""
    kind = RM_KIND

    def __init__(self, backbone: Backbone, tok: TokenizerWrapper, cfg: ModelConfig, optim: OptimConfig,
                 env: DistEnv, *, given: str, unfreeze_last: str, lora: LoraSpec | None, max_len: int, seed: int,
                 resume: tuple | None, checks: Checks, merge_lora: bool = False):
        self._start(env, cfg)
        self.backbone, self.tok, self.lora, self.merge_lora = backbone, tok, lora, merge_lora
        self.given, self.unfreeze_last, self.max_len = given, unfreeze_last, max_len
        # LoRA takes less than unfrozen blocks, not than a frozen backbone (its backward runs through every block)
        self.state_hints = (FEWER_RANKS_STATE,) + ((LORA_STATE.replace("--lora_r 16", "--lora_r 16 --unfreeze_last 0"),)
                                                   if unfreeze_last != "0" else ())
        hold_frozen_in(backbone, self.dtype)
        model = RewardModel(backbone)
        model.init_head(seed)
        model.to(env.device)
        print0(compile_models(cfg.compile, env.device, backbone))
        if cfg.activation_checkpointing:
            checkpoint_activations(backbone.blocks)
        if lora:
            print0(describe_lora(backbone))
        print0(f"model: {backbone.kind} backbone {backbone.source}, tokenizer {tok.kind}; "
               f"{sum(p.numel() for p in model.parameters() if p.requires_grad):,} trainable of "
               f"{sum(p.numel() for p in model.parameters()):,}")
        self._wrap(model, backbone.blocks, model, optim, backbone.model)
        self.backbone_print = fingerprint(backbone.source) if env.is_main else None  # so a moved RM finds it
        self._resume(resume, checks)

    def own_meta(self, into: Path, merge: bool) -> dict:
        """Where the backbone and tokenizer are (absolute, relative to the checkpoint and to $NANOCHAT_BASE_DIR) and
        what the RM was trained with."""
        backbone, tok = self.backbone, self.tok
        return {"backbone": str(Path(backbone.source).resolve()), "backbone_kind": backbone.kind,
                "backbone_ref": {**portable_paths(backbone.source, into), "given": self.given,
                                 "fingerprint": self.backbone_print},
                "tokenizer_ref": portable_paths(tok.source, into), "backbone_vintage": backbone.vintage,
                "tokenizer": str(Path(tok.source).resolve()), "tokenizer_kind": tok.kind,
                "max_len": self.max_len, "dtype": str(self.dtype).removeprefix("torch."),
                "unfreeze_last": self.unfreeze_last, "hidden_size": backbone.hidden_size,
                "lora": self.lora and {**self.lora.to_meta(), "merged": merge}}

    def write_whole(self, d: Path, stamp: int, meta: dict, state: dict | None, weights: dict | None, *,
                    merge: bool) -> Path:
        """Rank 0: the head and what trains (merge: the head and the adapted weights merged, the adapters themselves
        kept in the resume state)."""
        trained = trainable_state(self.model, weights)
        if merge and self.lora:
            merged = {f"backbone.model.{k}": v for k, v in merged_weights(self.backbone, adapted_only=True).items()}
            trained, state = {"head.weight": trained["head.weight"], **merged}, state and {**state, "trained": trained}
        return save_checkpoint(d, stamp, trained, meta, state)

    def load_whole(self, state: dict, path: Path) -> None:
        """A whole checkpoint's trained tensors: the model file's, or, where it holds merged weights (--merge_lora), the
        resume state's adapters."""
        weights = state.get("trained") or torch_load(path, "reward-model checkpoint")
        params = dict(self.model.named_parameters())
        if set(weights) != {n for n, p in params.items() if p.requires_grad}:
            raise InputError("checkpoint's trainable tensors do not match this run's --unfreeze_last and --lora_*",
                             path=str(path))
        with torch.no_grad():
            for name, tensor in weights.items():
                params[name].copy_(tensor)


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
