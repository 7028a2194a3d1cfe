"""What a training step holds on each rank, by arithmetic (the memory model of bench/memory_estimate.py,
docs/scaling.md's "which setting for which model and GPUs" table and the trainers' log), and the micro-batch it picks
where --device_batch_size is auto (the line of a run that does not fit: runtime/oom.py).

Per trained parameter: fp32 weights (4 bytes), fp32 gradients (4) and AdamW's two fp32 moments (8): 16 bytes on every
rank under ddp, 16 / N under fsdp, which adds the weights FSDP gathers in bf16 while they compute (the root's
embeddings and LM head through the step, two blocks at a time: one computing, one prefetched) and, while micro-batches
accumulate unsharded, every weight gathered in bf16 with its fp32 gradient (6 bytes). What does not train is held in
bf16 (2 bytes): GRPO's reward model, the RM's frozen blocks, GRPO's reference (under ddp its matmul weights only: its
embeddings stay fp32 like the policy's); the rollout engine's weights (a bf16 copy of the policy's matmul weights under
ddp, of all its weights under fsdp) and its KV cache, held through the run where the engine is compiled (its kept
decode states). Micro-batches that accumulate unsharded (accum > 1 under fsdp,
where memory allows: parallel.Parallel) hold every trained weight gathered and every gradient unsharded instead.

Activations of a training micro-batch, calibrated on fake-tensor runs of our own nanochat blocks under bf16 autocast
(bench/memory_estimate.py prints the calibration beside its fake-tensor measurement): per token and block, 71 bytes
per unit of width on CUDA without activation checkpointing (what a block saves for its backward; CUDA's autocast runs
pow and rms_norm in fp32), 55 under CPU's autocast, 11 with it on either (its input and the residual stream's); per
completion token the LM head's fp32 logits and log-softmax over the vocabulary, for at most 4096 tokens at once
(logprobs.token_logprobs_chunked); and under ddp the bf16 casts of the weights that autocast saves for the backward (the
LM head's, and the blocks' without activation checkpointing; under fsdp they are the gathered weights). Checked against
fake-tensor runs of a one-rank GRPO step (tests/test_bench.py); the fsdp terms are arithmetic only.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nanochat_ext.ddp_common import all_reduce_min, peak_memory_gb, print0
from nanochat_ext.models.gpt import GPT
from nanochat_ext.runtime.oom import GiB
from nanochat_ext.runtime.parallel import UNSHARDED_ACCUM_BYTES
from nanochat_ext.training.logprobs import CHUNK_TOKENS

# Per token, block and unit of width, by the autocast rules of the device (see the docstring), without and with
# activation checkpointing: CUDA's autocast runs pow and rms_norm in fp32, which a block saves for its backward.
ACT_BYTES = {"cpu": {False: 55, True: 11}, "cuda": {False: 71, True: 11}}


@dataclass(frozen=True)
class ModelShape:
    """A transformer's sizes, as the memory model needs them (nanochat GPT: model_shape)."""
    layers: int
    width: int
    vocab: int
    kv_heads: int
    head_dim: int
    params: int  # all of them
    block_params: int  # one transformer block's
    lm_head: int  # the LM head's (not a reward model's: it reads hidden states)

    @property
    def root_params(self) -> int:
        """Outside the blocks: embeddings (value embeddings too), the LM head, scalars."""
        return self.params - self.layers * self.block_params


def model_shape(model) -> ModelShape:
    """The shape of one of our nanochat GPTs (built on the meta device, or real)."""
    c = model.config
    blocks = model.transformer.h
    return ModelShape(c.n_layer, c.n_embd, c.vocab_size, c.n_kv_head, c.n_embd // c.n_head,
                      sum(p.numel() for p in model.parameters()),
                      max(sum(p.numel() for p in b.parameters()) for b in blocks), model.lm_head.weight.numel())


def backbone_shape(backbone) -> ModelShape:
    """The shape of any Backbone: nanochat GPT, our Llama, or a transformers module (by its config's usual names)."""
    if isinstance(backbone.model, GPT):
        return model_shape(backbone.model)
    c, blocks = backbone.model.config, backbone.blocks
    heads = getattr(c, "n_head", None) or c.num_attention_heads
    kv = getattr(c, "n_kv_head", None) or getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return ModelShape(len(blocks), c.hidden_size, c.vocab_size, kv, head_dim,
                      sum(p.numel() for p in backbone.parameters()),
                      max(sum(p.numel() for p in b.parameters()) for b in blocks),
                      sum(p.numel() for p in backbone.output_head_params()))


def describe(m: StepMemory, micro: int) -> str:
    """The log line of a memory model: each part, and the peak with its phase."""
    names = {**m.parts, **m.training, **{f"rollout {k}": v for k, v in m.rollout.items()}}
    parts = ", ".join(f"{k.replace('_', ' ')} {v / GiB:.3g}" for k, v in names.items())
    phase = "training" if m.phase("training") >= m.phase("rollout") else "rollout"
    return (f"memory: per rank by nanochat_ext/training/memory.py (bf16 on CUDA; GiB): {parts} (activations at "
            f"micro-batches of {micro}); peak {m.peak() / GiB:.3g} in {phase}")


@dataclass
class StepMemory:
    """Bytes per rank, part by part, and which phase peaks."""
    parts: dict[str, float] = field(default_factory=dict)  # always held
    training: dict[str, float] = field(default_factory=dict)  # on top, while a micro-batch trains
    rollout: dict[str, float] = field(default_factory=dict)  # on top, while the engine decodes (GRPO)

    def phase(self, name: str) -> float:
        """Bytes held while `name` ('training' or 'rollout') runs."""
        return sum(self.parts.values()) + sum(getattr(self, name).values())

    def peak(self) -> float:
        return max(self.phase("training"), self.phase("rollout"))

    def gib(self) -> dict[str, float]:
        flat = {**self.parts, **self.training, **{f"rollout_{k}": v for k, v in self.rollout.items()}}
        return {k: round(v / GiB, 2) for k, v in flat.items()} | {"peak": round(self.peak() / GiB, 2)}


def trained_state(s: ModelShape, trained: int, parallel: str, ranks: int, accum: int) -> tuple[dict, dict]:
    """(held, while training) bytes of the trained parameters: weights, gradients, AdamW; under fsdp the gathered
    weights too."""
    share = ranks if parallel == "fsdp" else 1
    held = {"weights": 4 * trained / share, "optimizer": 8 * trained / share}
    training = {"gradients": 4 * trained / share}
    if parallel == "fsdp":
        training["gathered"] = 2 * (s.root_params + 2 * s.block_params)
        if accum > 1:  # weights stay gathered and gradients unsharded between micro-batches
            training["gathered"] = UNSHARDED_ACCUM_BYTES * trained
    return held, training


def activations(s: ModelShape, tokens: int, completion_tokens: int, checkpointing: bool, casts: bool,
                device: str) -> float:
    """Bytes a training micro-batch keeps for its backward on a device of this type (see the module docstring)."""
    blocks = tokens * s.layers * s.width * ACT_BYTES["cuda" if device == "cuda" else "cpu"][checkpointing]
    head = 2 * 4 * s.vocab * min(completion_tokens, CHUNK_TOKENS)
    head_cast = 2 * (s.lm_head or s.vocab * s.width) if completion_tokens else 0  # a tied head casts the embedding
    weight_casts = (2 * s.layers * s.block_params if not checkpointing else 0) + head_cast if casts else 0
    return blocks + head + weight_casts


def matmuls_in_bf16(s: ModelShape) -> float:
    """Bytes of a model held as GRPO's reference is: matmul weights (blocks, LM head) in bf16, the rest fp32."""
    return 2 * (s.params - s.root_params + s.lm_head) + 4 * (s.root_params - s.lm_head)


def policy_memory(s: ModelShape, parallel: str, ranks: int, accum: int, reference: bool, lora: int) -> StepMemory:
    """What a policy's fine-tune holds before its activations: the trained state, and the frozen base (LoRA) or the
    reference (matmul weights in bf16; under fsdp, gathered in bf16, every weight, to compute as the policy)."""
    held, training = trained_state(s, lora or s.params, parallel, ranks, accum)
    m = StepMemory(held, training)
    if lora:
        m.parts["frozen_base"] = matmuls_in_bf16(s)
    elif reference:
        m.parts["reference"] = 2 * s.params if parallel == "fsdp" else matmuls_in_bf16(s)
    return m


def fine_tune_memory(s: ModelShape, *, parallel: str, ranks: int, checkpointing: bool, micro: int, row_len: int,
                     scored: int, pairs: int, reference: bool = True, device: str, lora: int = 0,
                     accum: int | None = None) -> StepMemory:
    """A policy of shape s fine-tuned on rows (DPO: a pair's prompt once, then both responses; SFT: a conversation):
    micro-batches of `micro` rows of up to row_len tokens with `scored` tokens each that take loss, `accum`
    micro-batches per step (None: all of the rank's `pairs` rows)."""
    m = policy_memory(s, parallel, ranks, pairs // micro if accum is None else accum, reference, lora)
    m.training["activations"] = activations(s, micro * row_len, micro * scored, checkpointing,
                                            parallel == "ddp" and not lora, device)
    return m


def grpo_memory(s: ModelShape, *, parallel: str, ranks: int, checkpointing: bool, micro: int, prompt_len: int,
                new_tokens: int, rows: int, accum: int | None = 1, reference: bool = True,
                rm: ModelShape | None = None, device: str, lora: int = 0, kept_rows: tuple[int, ...] = (),
                slots: int = 0, teacher: ModelShape | None = None, rollout_copy: int = 0) -> StepMemory:
    """GRPO's fine-tune of a policy of shape s: `rows` sequences decoded at once per rank, micro-batches of `micro`
    sequences, `accum` of them per step (None: all of them, rows // micro). lora: the adapters' parameter count under
    --lora_r (lora.adapter_params): they alone train; the base is held as the reference would be, and the reference is
    the base itself. kept_rows: the row counts of the decode states a compiled engine keeps through the run (one per row
    count: the rollouts', the evaluation's calls', evaluation.eval_decode_rows), each a KV cache of `slots` positions
    and the step's logits buffers (on CUDA the graph pool's): held, not only while decoding. teacher: distillation's.
    rollout_copy (--async_rollouts): the bytes of the rollout engine's whole copy of the policy, held; its (eager)
    decoding of the next step's rollout runs while the training does."""
    m = policy_memory(s, parallel, ranks, rows // micro if accum is None else accum, reference, lora)
    if rm is not None:
        m.parts["reward_model"] = 2 * (rm.params - rm.lm_head)
    if teacher is not None:  # --advantage distill's, whole on every rank, held as the reference is
        m.parts["teacher"] = matmuls_in_bf16(teacher)
    # the engine decodes from bf16 copies of the fp32 weights: under LoRA the adapters' only
    m.parts["engine_weights"] = 2 * (lora if lora else s.params if parallel == "fsdp"
                                     else s.layers * s.block_params + s.lm_head)
    T = prompt_len + new_tokens
    m.training["activations"] = activations(s, micro * T, micro * new_tokens, checkpointing,
                                            parallel == "ddp" and not lora, device)  # a bf16 base needs no casts
    def decoding(n: int, positions: int) -> dict[str, float]:
        return {"kv_cache": n * positions * s.layers * 2 * s.kv_heads * s.head_dim * 2,
                "logits": n * s.vocab * 4 * 3}  # the step's logits, probabilities and their running sums

    if kept_rows:
        m.parts["decode_states"] = sum(sum(decoding(n, max(slots, T)).values()) for n in kept_rows)
    else:
        m.rollout.update(decoding(rows, T))
    if rollout_copy:
        m.parts["rollout_copy"] = rollout_copy
        m.training.update({f"rollout_{k}": v for k, v in decoding(rows, T).items()})
    return m


def rm_memory(s: ModelShape, *, parallel: str, ranks: int, checkpointing: bool, micro: int, seq_len: int,
              device: str, pairs: int | None = None, accum: int | None = None, unfreeze: str = "all",
              lora: int = 0) -> StepMemory:
    """The RM's fine-tune of a backbone of shape s (the last `unfreeze` blocks, or all; or adapters of `lora`
    parameters in every block), `micro` pairs a micro-batch, `accum` micro-batches a step (None: all of the rank's
    `pairs`, default one micro-batch's)."""
    n = s.layers if unfreeze == "all" or lora else int(unfreeze)
    trained = lora or ((s.params - s.lm_head) if unfreeze == "all" else n * s.block_params)
    held, training = trained_state(s, trained, parallel, ranks, (pairs or micro) // micro if accum is None else accum)
    m = StepMemory(held, training)
    m.parts["frozen"] = 2 * (s.params - trained)
    tokens = 2 * micro * seq_len
    sub = ModelShape(n, s.width, s.vocab, s.kv_heads, s.head_dim, s.params, s.block_params, 0)
    m.training["activations"] = activations(sub, tokens, 0, checkpointing, parallel == "ddp", device)
    return m


def report_peak(device, estimate: StepMemory) -> None:
    """Collective on CUDA: log the measured peak (the largest over ranks) beside the estimate; nothing on CPU."""
    measured = peak_memory_gb(device)
    if measured:
        print0(f"memory: measured peak {measured['perf/max_mem_allocated_gb']:.2f} GiB per rank (the largest over "
               f"ranks) against the estimate's {estimate.peak() / GiB:.2f}")


# ---- a micro-batch that fits by itself ------------------------------------------------------------------------------
FREE_BYTES_ENV = "NANOCHAT_EXT_FREE_BYTES"  # on CPU: the memory a run may take (a limit the tests simulate)
AUTO_MARGIN = 0.15  # of the free memory, left for what the arithmetic does not see (allocator rounding, workspaces)


def free_memory(device) -> int | None:
    """Collective: the bytes a rank may hold in all, the least over ranks: on CUDA what is free plus what this process
    holds already (the weights the estimate counts are loaded by now), on CPU $NANOCHAT_EXT_FREE_BYTES where set;
    None where no limit is known (CPU)."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
    else:
        value = os.environ.get(FREE_BYTES_ENV)
        free = int(value) if value else None
    if free is None:
        return None
    return int(all_reduce_min(float(free)))


def pick_micro_batch(per_rank: int, estimate: Callable[..., StepMemory], free: int | None,
                     margin: float = AUTO_MARGIN, prefer: int = 1) -> tuple[int, str]:
    """--device_batch_size auto: the largest micro-batch that divides this rank's share of the global batch and whose
    estimated peak (the memory model, at the run's longest sequences; `estimate(micro=size)`) is at most (1 - margin) of
    the memory a rank may hold: all of the share where no limit is known; 1, said so, where none fits. Multiples of
    `prefer` first (GRPO's group size: whole groups share their prompt). The same on every rank (free is the least
    over ranks). Returns (size, the log line with the figures it used)."""
    sizes = divisors(per_rank)
    if free is None:
        return per_rank, f"micro-batch: auto: {per_rank} (no memory limit known on this device)"
    budget = (1 - margin) * free
    peaks = {m: estimate(micro=m).peak() for m in sizes}
    order = [m for m in sizes if m % prefer == 0] + [m for m in sizes if m % prefer]
    m = next((m for m in order if peaks[m] <= budget), None)
    tried = ", ".join(f"{k}: {peaks[k] / GiB:.3g}" for k in sizes)
    verdict = f"{m} of {per_rank}" if m else f"1 of {per_rank}, though none fits by the estimate,"
    return m or 1, (f"micro-batch: auto: {verdict} per rank (estimated peak GiB by size: {tried}; room "
                    f"{free / GiB:.3g} GiB, the least over ranks, less a {margin:.0%} margin: {budget / GiB:.3g})")


def auto_pick(per_rank: int, estimate: Callable[..., StepMemory], device, resume: tuple | None,
              prefer: int = 1) -> tuple[int, str]:
    """Collective: --device_batch_size auto for a run: the size the run it resumes picked (the same micro-batches: an
    exact resume, whatever memory is free now), else pick_micro_batch's over the memory free now."""
    saved = resume[2].get("device_batch_size") if resume is not None else None
    if saved and per_rank % int(saved) == 0:  # (another number of ranks may not split into it)
        return int(saved), f"micro-batch: auto: {saved}, as picked by the run this one resumes"
    return pick_micro_batch(per_rank, estimate, free_memory(device), prefer=prefer)


def divisors(n: int) -> list[int]:
    """The micro-batch sizes that split a share of n rows evenly, largest first."""
    return [m for m in range(n, 0, -1) if n % m == 0]


def micro_batch_for(wanted: int | str | None, share: int, estimate_for: Callable[..., StepMemory], device,
                    resume: tuple | None, prefer: int = 1) -> tuple[int, StepMemory]:
    """Collective: --device_batch_size for a rank's `share` rows, and the memory model's estimate at it (both lines
    printed): as given; the whole share where not given on CPU; picked by the memory model for 'auto', or where not
    given on CUDA (auto_pick)."""
    micro = share if wanted in (None, "auto") else int(wanted)
    if wanted == "auto" or (wanted is None and device.type == "cuda"):
        micro, line = auto_pick(share, estimate_for, device, resume, prefer=prefer)
        print0(line)
    estimate = estimate_for(micro=micro)
    print0(describe(estimate, micro))
    return micro, estimate
