"""Peak memory of the RM and GRPO steps on a nanochat d20-shaped model, estimated without a GPU.

The steps run on fake tensors (torch's FakeTensorMode: shapes and dtypes, no data, no compute) under
bf16 autocast, with the library's own modules; a dispatch hook counts the bytes of every live tensor
storage and keeps the peak. That is what torch.cuda.max_memory_allocated measures, less the caching
allocator's rounding and the kernels' workspaces (cuBLAS, SDPA), so read it as a lower bound within
a few percent. "before" is the code before the GPU work (frozen weights fp32, KV cache fp32, the LM
head's log-softmax over the whole batch at once); "after" is today's.

Beside each fake-tensor GRPO run (today's code, with and without --activation_checkpointing) it prints the
arithmetic of nanochat_ext/training/memory.py for the same run (one rank, ddp): the check that the arithmetic holds.
With --model the arithmetic alone, for any shape, --parallel ddp|fsdp over --ranks, with --activation_checkpointing,
with --lora_r (LoRA on every linear layer of the blocks, arithmetic only); with --table docs/scaling.md's "which setting
for which model and GPUs" table.

    python bench/memory_estimate.py            # one JSON line per configuration
    python bench/memory_estimate.py --model d32:32768 --parallel fsdp --ranks 8 --activation_checkpointing
    python bench/memory_estimate.py --model d24:32768 --lora_r 16
    python bench/memory_estimate.py --table    # markdown
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakIdKeyDictionary

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_measure import shape_config  # noqa: E402

from nanochat_ext.algorithms.grpo import LossConfig, grpo_loss
from nanochat_ext.models.backbone import Backbone, hold_frozen_in
from nanochat_ext.models.gpt import GPT
from nanochat_ext.models.lora import LoraSpec, adapter_params
from nanochat_ext.models.reward_model import RewardModel
from nanochat_ext.training.logprobs import CompletionLogprobs, reference_model
from nanochat_ext.training.memory import GiB, grpo_memory, model_shape, rm_memory
from nanochat_ext.training.optim import make_adamw


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage alive now and at the peak (each storage counted once, freed when collected)."""

    def __init__(self):
        super().__init__()
        self.seen = WeakIdKeyDictionary()
        self.live = self.peak = 0

    def _free(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                if s not in self.seen:
                    self.seen[s] = n = s.nbytes()
                    self.live += n
                    weakref.finalize(s, self._free, n)
        self.peak = max(self.peak, self.live)
        return out


def backbone(cfg, frozen_dtype: torch.dtype | None) -> Backbone:
    bb = Backbone("nanochat", GPT(cfg), "fake").eval()
    if frozen_dtype is not None:
        hold_frozen_in(bb.requires_grad_(False), frozen_dtype)
    return bb


def rm_step(cfg, unfreeze: str, after: bool, pairs: int, T: int) -> float:
    with FakeTensorMode(), LiveBytes() as mem:
        bb = backbone(cfg, None)
        bb.set_trainable(unfreeze)
        bb.model.lm_head.weight.requires_grad_(False)
        if after:
            hold_frozen_in(bb, torch.bfloat16)
        model = RewardModel(bb)
        opt = make_adamw([p for p in model.parameters() if p.requires_grad], 1e-5, 0.0, torch.device("cpu"))
        ids, lengths = torch.randint(0, cfg.vocab_size, (2 * pairs, T)), torch.full((2 * pairs,), T)
        for _ in range(2):  # the second step holds the optimizer state
            with torch.autocast("cpu", dtype=torch.bfloat16):
                r = model(ids, lengths).float()
                loss = -F.logsigmoid(r[:pairs] - r[pairs:]).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del r, loss
        return mem.peak / GiB


def grpo_step(cfg, after: bool, prompts: int, G: int, P: int, L: int, micro: int, ac: bool,
              device: str) -> dict[str, float]:
    """Peaks of the phases of one GRPO step, each on top of what lives through the whole run (policy,
    its AdamW state, reference, RM): generation (prefill, cache x G, one decode step), reference
    log-probs and RM scoring of the whole batch, and a training micro-batch (forward, loss, backward,
    AdamW step). device: whose autocast rules apply ('cuda': CUDA's, where pow and rms_norm run in fp32, see
    CudaAutocastRules; 'cpu': CPU's, where they stay bf16)."""
    frozen = torch.bfloat16 if after else torch.float32
    chunk = 4096 if after else 1 << 40
    n = prompts * G
    out = {}
    with FakeTensorMode(), LiveBytes() as mem, autocast_rules(device):
        policy = backbone(cfg, None)
        if device == "cuda":  # a block's recompute in backward (--activation_checkpointing) runs outside this mode
            for block in policy.blocks:
                block.forward = under_cuda_rules(block.forward)
        if ac:
            from nanochat_ext.runtime.parallel import checkpoint_activations

            checkpoint_activations(policy.blocks)
        model = CompletionLogprobs(policy, chunk)
        reference = reference_model(backbone(cfg, None), frozen, chunk_tokens=chunk)  # as the trainer holds it
        rm = RewardModel(backbone(cfg, frozen)).requires_grad_(False)
        opt = make_adamw(list(model.parameters()), 1e-6, 0.0, torch.device("cpu"))
        # AdamW's state exists after the first step: allocate it as the step would.
        for p in model.parameters():
            opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p),
                            "exp_avg_sq": torch.zeros_like(p)}
        resident = mem.live
        out["resident"] = resident / GiB

        mem.peak = mem.live
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            if not after:  # the cache took the weights' fp32 before
                policy.model.new_kv_cache = _fp32_cache(policy.model)
            logits, cache = policy.prefill(torch.randint(0, cfg.vocab_size, (prompts, P)), None, P + L)
            policy.repeat_cache(cache, G)
            logits = logits.repeat_interleave(G, dim=0)
            cache.pos = P + L - 1  # the last decode step attends over the full length
            logits = policy.decode(cache, torch.zeros(n, dtype=torch.long), None)
            del logits, cache
        out["generation"] = mem.peak / GiB

        T = P + L
        ids = torch.randint(0, cfg.vocab_size, (micro, T))
        gather = torch.arange(P - 1, T - 1).expand(micro, L)
        target = torch.randint(0, cfg.vocab_size, (micro, L))
        mem.peak = mem.live
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            ref = torch.zeros(n, L)  # all completions' reference log-probs, kept for training
            ref[:micro] = reference(ids, gather, target)[0].float()
            rm(ids, torch.full((micro,), T))
        out["reference_and_scoring"] = mem.peak / GiB

        mem.peak = mem.live
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp, _ = model(ids, gather, target)
            ones = torch.ones(micro, L)
            loss, _ = grpo_loss(logp, logp.detach(), ref[:micro], ones[:, 0], ones, ones[:, 0],
                                LossConfig("token", beta=0.04, max_new_tokens=L), float(n * L))
        loss.backward()
        del logp, loss
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["training"] = mem.peak / GiB
    return out


# The ops our models run whose autocast dtype differs between CUDA and CPU: CUDA runs them in fp32 (rms_norm from torch
# 2.12), CPU in bf16. tests/test_bench.py checks this list against torch's own CUDA autocast, on fake CUDA tensors.
CUDA_FP32_OPS = (torch.pow, torch.Tensor.pow, torch.square, torch.Tensor.square, torch.rms_norm, F.rms_norm,
                 torch.softmax, F.softmax, torch.Tensor.softmax, torch.log_softmax, F.log_softmax,
                 torch.Tensor.log_softmax)


class CudaAutocastRules(TorchFunctionMode):
    """Under CPU autocast, CUDA's autocast rules for CUDA_FP32_OPS: their floating inputs cast to fp32 (autocast's
    casts, which a backward saves), their outputs fp32. Fake CUDA tensors would apply CUDA's rules themselves, but on
    a machine without a GPU they cannot be sliced or indexed, which every forward does."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in CUDA_FP32_OPS and torch.is_autocast_enabled("cpu"):
            def up(t):
                return t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t

            with torch.autocast("cpu", enabled=False):
                return func(*tree_map(up, args), **tree_map(up, kwargs))
        return func(*args, **kwargs)


def under_cuda_rules(forward):
    def run(*args, **kwargs):
        with CudaAutocastRules():
            return forward(*args, **kwargs)
    return run


def autocast_rules(device: str):
    """The autocast rules of `device` on top of CPU autocast: CUDA's (CudaAutocastRules), or CPU's own."""
    return CudaAutocastRules() if device == "cuda" else contextlib.nullcontext()


def _fp32_cache(model: GPT):
    from nanochat_ext.models.attention import KVCache

    def new_kv_cache(batch: int, max_len: int) -> KVCache:
        c = model.config
        with torch.autocast("cpu", enabled=False):
            return KVCache(c.n_layer, batch, c.n_kv_head, c.n_embd // c.n_head, max_len, "cpu", torch.float32)
    return new_kv_cache


def shape_of(name: str):
    """nanochat_ext.training.memory's ModelShape of nanochat shape `name` (gpu_measure.shape_config),
    built on the meta device."""
    with torch.device("meta"):
        return model_shape(GPT(shape_config(name)))


def lora_params(name: str, r: int) -> int:
    """Adapter parameters of --lora_r r on every linear layer of the blocks of nanochat shape `name` (the default
    targets), counted as nanochat_ext.models.lora counts them."""
    with torch.device("meta"):
        bb = Backbone("nanochat", GPT(shape_config(name)), "meta")
    return adapter_params(bb, LoraSpec(r, 2.0 * r))


def arithmetic(name: str, parallel: str, ranks: int, ac: bool, b, lora_r: int = 0) -> list[dict]:
    """The memory model's GRPO and RM lines for one shape and setting, by CUDA's autocast rules: the global batch of
    the fake-tensor runs (prompts x group_size completions, rm_pairs pairs) split over the ranks."""
    s = shape_of(name)
    rows = b.prompts * b.group_size // ranks
    lora = lora_params(name, lora_r) if lora_r else 0
    grpo = grpo_memory(s, parallel=parallel, ranks=ranks, checkpointing=ac, micro=min(b.micro, rows),
                       prompt_len=b.prompt_len, new_tokens=b.new_tokens, rows=rows, rm=s, lora=lora, device="cuda")
    rm = rm_memory(s, parallel=parallel, ranks=ranks, checkpointing=ac, micro=max(1, b.rm_pairs // ranks),
                   seq_len=b.rm_len, lora=lora, device="cuda")
    common = {"shape": name, "params": s.params, "parallel": parallel, "ranks": ranks, "activation_checkpointing": ac,
              "lora_r": lora_r, "lora_params": lora}
    return [{"bench": "memory_model_grpo", **common, "completions_per_rank": rows, "micro": min(b.micro, rows),
             **{f"gb_{k}": v for k, v in grpo.gib().items()}},
            {"bench": "memory_model_rm", **common, "pairs_per_rank": max(1, b.rm_pairs // ranks), "seq_len": b.rm_len,
             **{f"gb_{k}": v for k, v in rm.gib().items()}}]


# docs/scaling.md's table: nanochat's shapes at its tokenizer's 32768 vocabulary (scripts/tok_train.py), widths by its
# rule (gpu_measure.nanochat_dims), and the settings that reach them.
TABLE_SHAPES = ("d20:32768", "d24:32768", "d26:32768", "d32:32768")
TABLE_SETTINGS = (("ddp", 1, False, 0), ("ddp", 1, False, 16), ("ddp", 1, True, 16), ("fsdp", 1, True, 0),
                  ("fsdp", 2, False, 0), ("fsdp", 2, True, 0), ("fsdp", 8, False, 0), ("fsdp", 8, True, 0))


def table(b) -> str:
    head = ("| model | params | " + " | ".join(f"{p} x{n}{' LoRA r' + str(r) if r else ''}{' +AC' if ac else ''}"
                                              for p, n, ac, r in TABLE_SETTINGS) + " |")
    lines = [head, "|" + "---|" * (len(TABLE_SETTINGS) + 2)]
    for name in TABLE_SHAPES:
        for bench in ("grpo", "rm"):
            cells = [next(line for line in arithmetic(name, p, n, ac, b, r) if line["bench"] == f"memory_model_{bench}")
                     for p, n, ac, r in TABLE_SETTINGS]
            label = f"{name.split(':')[0]} {'GRPO' if bench == 'grpo' else 'RM'}"
            lines.append(f"| {label} | {cells[0]['params'] / 1e9:.2f}B | "
                         + " | ".join(f"{c['gb_peak']:.0f}" for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="d20")
    p.add_argument("--model", default=None, help="the arithmetic alone for these shapes (comma-separated, e.g. "
                                                 "d24:32768,d32:32768)")
    p.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp")
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--activation_checkpointing", action="store_true")
    p.add_argument("--lora_r", type=int, default=0, help="with --model: LoRA of this rank (0: a full fine-tune)")
    p.add_argument("--table", action="store_true", help="docs/scaling.md's table (markdown), from the arithmetic")
    p.add_argument("--vintage", default="current", help="dec2025: the 561M-parameter d20 (no value embeddings)")
    p.add_argument("--rm_pairs", type=int, default=32)
    p.add_argument("--rm_len", type=int, default=512)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group_size", type=int, default=16)
    p.add_argument("--prompt_len", type=int, default=128)
    p.add_argument("--new_tokens", type=int, default=512)
    p.add_argument("--micro", type=int, default=32, help="sequences per training / reference forward")
    b = p.parse_args()
    if b.table:
        print(table(b))
        return
    if b.model:
        for name in b.model.split(","):
            for line in arithmetic(name, b.parallel, b.ranks, b.activation_checkpointing, b, b.lora_r):
                print(json.dumps(line), flush=True)
        return
    cfg = shape_config(b.shape, b.vintage)
    with FakeTensorMode():
        params = sum(q.numel() for q in GPT(cfg).parameters())
    for when in ("before", "after"):
        for unfreeze in ("0", "2", "all"):
            print(json.dumps({"bench": "memory_rm", "shape": b.shape, "vintage": b.vintage,
                              "params": params, "code": when,
                              "unfreeze_last": unfreeze, "pairs": b.rm_pairs, "seq_len": b.rm_len,
                              "peak_gb": round(rm_step(cfg, unfreeze, when == "after", b.rm_pairs, b.rm_len), 2)}),
                  flush=True)
        phases = grpo_step(cfg, when == "after", b.prompts, b.group_size, b.prompt_len, b.new_tokens, b.micro, False,
                           "cpu")
        print(json.dumps({"bench": "memory_grpo", "shape": b.shape, "vintage": b.vintage,
                          "params": params, "code": when,
                          "completions": b.prompts * b.group_size, "prompt_len": b.prompt_len,
                          "new_tokens": b.new_tokens, "micro": b.micro,
                          **{f"peak_gb_{k}": round(v, 2) for k, v in phases.items()},
                          "peak_gb": round(max(phases.values()), 2)}), flush=True)
    for device in ("cpu", "cuda"):  # the arithmetic beside the fake-tensor run it models, by each device's rules
        for ac in (False, True):
            fake = grpo_step(cfg, True, b.prompts, b.group_size, b.prompt_len, b.new_tokens, b.micro, ac, device)
            print(json.dumps({"bench": "memory_model_check", "shape": b.shape, "autocast_rules": device,
                              "activation_checkpointing": ac, "fake_gb_training": round(fake["training"], 2),
                              "model_gb_training": round(modelled_training(b.shape, ac, b, device) / GiB, 2)}),
                  flush=True)


def modelled_training(name: str, ac: bool, b, device: str) -> float:
    """The arithmetic's training phase of grpo_step's run (one rank, ddp, `device`'s autocast rules), less the rollout
    engine's weights, which the trainer keeps and grpo_step (decoding from the policy itself) does not."""
    s = shape_of(name)
    rows = b.prompts * b.group_size
    m = grpo_memory(s, parallel="ddp", ranks=1, checkpointing=ac, micro=b.micro, prompt_len=b.prompt_len,
                    new_tokens=b.new_tokens, rows=rows, rm=s, device=device)
    return m.phase("training") - m.parts["engine_weights"]


if __name__ == "__main__":
    main()
