"""--parallel: how a trainer spreads the model it trains over the ranks, and --activation_checkpointing.

ddp: every rank holds the whole model, its gradients and its optimizer state (DistributedDataParallel over the
    trainable parameters). The checkpoint is the input's own layout plus a state_<stamp>.pt with the optimizer.
fsdp: PyTorch's FSDP2 (`fully_shard`): each transformer block that trains is one shard group, the rest of what
    trains (embeddings, LM head, RM head) the root's. A rank holds 1/N of every trainable parameter, its
    gradient and its AdamW moments, and all-gathers a block's weights just before the block runs. On CUDA the
    gathered weights are bf16 and gradients are reduced in fp32 (MixedPrecisionPolicy); on CPU everything is
    fp32 over gloo. What does not train (the RM's frozen blocks, GRPO's reference and reward model) is not
    sharded: it is held whole on every rank in the compute dtype (bf16 on CUDA), 2 bytes a parameter against
    the 16 / N a trained one costs, and it needs no collective to run. Gradients reduce-scatter with the same
    average over ranks DDP's all-reduce takes, so the losses' global-batch normalisation holds unchanged.
    Checkpoints while training are sharded (torch.distributed.checkpoint: every rank writes its shards of the
    weights and the optimizer state, `shards_<stamp>/`), and they load onto another number of ranks; the final
    one is also written whole in the input's own layout, which every later stage and nanochat load.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn

from nanochat_ext.ddp_common import DistEnv, all_reduce_min, is_main, is_sharded, whole, wrap_ddp
from nanochat_ext.errors import InputError
from nanochat_ext.runtime.checkpoint import is_shards, save_checkpoint, save_synced

UNSHARDED_ACCUM_BYTES = 6  # per trained parameter, accumulating unsharded under fsdp: bf16 weight + fp32 gradient
PARALLEL_MODES = ("ddp", "fsdp")


class Parallel:
    """One --parallel mode for a run: wraps the trained model, and saves and loads what it holds."""

    def __init__(self, mode: str, env: DistEnv, dtype: torch.dtype):
        if mode not in PARALLEL_MODES:
            raise InputError(f"--parallel must be {' or '.join(PARALLEL_MODES)}, got {mode!r}")
        if mode == "fsdp" and not env.is_distributed:
            raise InputError("--parallel fsdp needs a process group: run it under torchrun (one rank is fine)")
        self.mode, self.env, self.dtype = mode, env, dtype
        self.mesh = None
        if self.sharded:
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh(env.device.type, (env.world_size,))

    @property
    def sharded(self) -> bool:
        return self.mode == "fsdp"

    @property
    def gathers_in(self) -> torch.dtype | None:
        """The dtype FSDP gathers weights in and computes with when it is not theirs: bf16 under fsdp on CUDA with
        bf16 compute (MixedPrecisionPolicy); None otherwise (fsdp on CPU, and ddp, compute from the fp32 weights)."""
        lower = self.sharded and self.env.device.type == "cuda" and self.dtype == torch.bfloat16
        return torch.bfloat16 if lower else None

    def wrap(self, model: nn.Module, blocks: nn.ModuleList) -> nn.Module:
        """ddp: DDP over model's trainable parameters. fsdp: model itself, sharded in place (a block that
        trains is a shard group of its own, the trainable rest the root's; frozen parameters stay whole)."""
        if not self.sharded:
            return wrap_ddp(model, self.env)
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # FSDP2 warns, at every forward, that a block or the RM returns a view: an in-place op on one would skip
        # its pre-backward all-gather. Nothing here writes into a block's output in place (residuals are added
        # out of place), and the fsdp = ddp = one rank tests would see the wrong gradients if it did.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")

        mesh = self.mesh
        mp = MixedPrecisionPolicy(param_dtype=self.gathers_in, reduce_dtype=torch.float32) if self.gathers_in \
            else MixedPrecisionPolicy()
        for block in blocks:
            if any(p.requires_grad for p in block.parameters()):
                fully_shard(block, mesh=mesh, mp_policy=mp)
        frozen = {p for p in model.parameters() if not p.requires_grad}
        fully_shard(model, mesh=mesh, mp_policy=mp, ignored_params=frozen or None)
        model.accumulate_unsharded = self._accumulate_unsharded(model)  # read by no_sync
        return model

    def _accumulate_unsharded(self, model: nn.Module) -> bool:
        """Whether micro-batches may accumulate with every weight gathered and every gradient unsharded (bf16 weights
        and fp32 gradients: 6 bytes a trained parameter, nanochat_ext.training.memory): on CUDA while that takes at most
        half the memory free once the model is placed, else each micro-batch's gradients are reduce-scattered at
        once."""
        if self.env.device.type != "cuda":
            return True
        extra = UNSHARDED_ACCUM_BYTES * sum(p.numel() for p in model.parameters() if p.requires_grad)
        free = all_reduce_min(torch.cuda.mem_get_info(self.env.device)[0])  # the least free: every rank decides alike
        return extra <= free / 2

    def describe(self, model: nn.Module) -> str:
        """The log line: what each rank holds."""
        if not self.sharded:
            return f"parallel: ddp over {self.env.world_size} ranks (every rank holds the whole model)" \
                if self.env.world_size > 1 else "parallel: one process"
        shards = [p for p in model.parameters() if is_sharded(p)]
        frozen = [p for p in model.parameters() if not is_sharded(p)]
        local = sum(p.to_local().numel() * p.element_size() for p in shards) / 2**20
        held = sum(p.numel() * p.element_size() for p in frozen) / 2**20
        frozen_part = (f"; {sum(p.numel() for p in frozen):,} frozen ones whole on every rank ({held:.1f} MiB)"
                       if frozen else "")
        accumulate = "unsharded" if getattr(model, "accumulate_unsharded", True) else "reduce-scattered per micro-batch"
        return (f"parallel: fsdp over {self.env.world_size} ranks: {sum(p.numel() for p in shards):,} trained "
                f"parameters sharded ({local:.1f} MiB of them on this rank, as much again for their gradients and "
                f"twice that for AdamW's moments){frozen_part}; gradients of micro-batches "
                f"accumulate {accumulate}")

    def save(self, into: Path, model: nn.Module, optimizer, *, module: nn.Module, final: bool, consolidate: bool,
             meta: dict, state: dict, write_whole: Callable[..., Path]) -> Path:
        """Collective: one checkpoint of `model` into `into`; returns its path on every rank. ddp: the whole model and
        the optimizer state, as always. fsdp: the shards (weights and optimizer state), and on the final save also the
        whole model gathered from them: `module`'s state dict (the part whose layout is written: the backbone's model,
        or the RM). consolidate (--consolidate): the whole model and its meta only, nothing to resume from.
        meta: the meta json but its stamp; state: the resume state but the optimizer's; write_whole(into, stamp, meta,
        train_state, weights): rank 0 writes the whole model in its layout (weights: gathered, or None: its own)."""
        whole_now = not self.sharded or final or consolidate
        weights = self.whole_state_dict(module) if self.sharded and whole_now else None
        shards = None if consolidate or not self.sharded else functools.partial(self.save_shards, model=model,
                                                                                 optimizer=optimizer)
        train_state = None if consolidate else {**state,
                                                **({} if self.sharded else {"optimizer": optimizer.state_dict()})}
        return save_synced(into, [p for p in model.parameters() if p.requires_grad],
                           functools.partial(write_stamped, into, meta, train_state, weights,
                                             write_whole if whole_now else None), shards)

    def resume(self, path: Path, model: nn.Module, optimizer) -> bool:
        """Collective: load a sharded checkpoint (shards_<stamp>/) into model and optimizer and return True,
        whichever --parallel wrote it; False for a whole checkpoint under ddp (the trainer loads it as ever). Under
        fsdp a whole checkpoint is refused: DDP's optimizer state is keyed by position, not by name."""
        if is_shards(path):
            self.load_shards(path, model, optimizer)
            return True
        if self.sharded:
            raise InputError("a whole checkpoint without shards (a --parallel ddp run's): its optimizer state is not "
                             "sharded; resume it with --parallel ddp", path=str(path))
        return False

    def whole_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Collective under fsdp: module's state dict, every tensor whole and on CPU, on rank 0 (other ranks
        take part in the gathers and get {}). module may be a part of the wrapped model (a backbone)."""
        out = {}
        for k, v in module.state_dict().items():
            v = whole(v)
            if is_main():
                out[k] = v.detach().cpu()
        return out

    def save_shards(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Collective: every rank writes its shards of the trained weights and of the optimizer state into the
        directory path (torch.distributed.checkpoint). Frozen parameters are left out: they are the input's."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        weights, optim = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
        dcp.save({"model": weights, "optimizer": optim}, checkpoint_id=str(path))

    def load_shards(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Collective: load save_shards' directory into model and optimizer, whatever the number of ranks that
        wrote it (and into a DDP or a one-process model too)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

        options = StateDictOptions(ignore_frozen_params=True)
        weights, optim = get_state_dict(model, optimizer, options=options)
        state = {"model": weights, "optimizer": optim}
        try:
            dcp.load(state, checkpoint_id=str(path))
        except Exception as e:  # a missing or garbled shard file: torch raises its own types
            raise InputError(f"cannot read the sharded checkpoint ({str(e).splitlines()[0][:200]})",
                             path=str(path)) from None
        # Not strict: the frozen parameters were left out on purpose; anything else missing is an error.
        loaded = set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                                options=StateDictOptions(ignore_frozen_params=True, strict=False))
        frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        missing = [k for k in loaded.missing_keys if k not in frozen]
        if missing or loaded.unexpected_keys:
            raise InputError(f"the sharded checkpoint does not fit this model (missing {missing[:3]}, unexpected "
                             f"{list(loaded.unexpected_keys)[:3]})", path=str(path))


def write_stamped(into: Path, meta: dict, state: dict | None, weights: dict | None,
                  write_whole: Callable[..., Path] | None, stamp: int) -> Path:
    """Rank 0, once the stamp is chosen (checkpoint.save_synced): the whole model in its layout (write_whole), or
    beside the shards only the meta and the resume state."""
    meta = {"stamp": stamp, **meta}
    if write_whole is not None:
        return write_whole(into, stamp, meta, state, weights)
    return save_checkpoint(into, stamp, None, meta, state)


def no_sync(module: nn.Module, skip_sync: bool) -> contextlib.AbstractContextManager:
    """A micro-batch that is not the step's last: DDP's no_sync(); under FSDP, where memory allows
    (Parallel._accumulate_unsharded), gradients accumulate unsharded and the blocks' weights stay gathered after the
    forward and the backward (no reduce-scatter, and no all-gather but the first forward's, until the last
    micro-batch, which reshards after its forward as a lone micro-batch does: one all-gather per block for its
    backward), else every micro-batch's gradients are reduce-scattered. A null context for a plain module."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        if getattr(module, "accumulate_unsharded", True):
            module.set_requires_gradient_sync(not skip_sync)
            module.set_reshard_after_backward(not skip_sync)
            for block in module.modules():  # not the root, which FSDP keeps gathered from forward to backward
                if isinstance(block, FSDPModule) and block is not module:
                    block.set_reshard_after_forward(not skip_sync, recurse=False)
        return contextlib.nullcontext()
    if skip_sync and hasattr(module, "no_sync"):
        return module.no_sync()
    return contextlib.nullcontext()


def checkpoint_activations(blocks: nn.ModuleList) -> None:
    """--activation_checkpointing: each block keeps only its input for the backward pass and recomputes the
    rest there (torch.utils.checkpoint, non-reentrant), for the calls that build a graph; the same gradients.
    Calls without grad (decoding, the reference, scoring) run the block as it is."""
    from torch.utils.checkpoint import checkpoint

    for block in blocks:
        inner = block.forward

        def forward(*args, _inner=inner, **kwargs):
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        forward.wraps_block = True  # engine copies drop it (see compiled._without_cache)
        block.forward = forward
