"""What the rollout engine decodes from, beside the policy itself: a copy of its matmul weights in a lower precision,
and on CPU the fp32 matmul weights packed for MKL.

Under a lower-precision autocast (bf16 on CUDA) the engine decodes from its own copy of the policy's matmul weights in
that dtype, refreshed from the fp32 masters at every call (a rollout, an evaluation). Autocast would cast the masters
to the same values at every matmul, so the tokens are bitwise those of the masters under autocast, but a step reads
half the weight bytes and casts nothing (but an LM head tied to the embedding, which stays the policy's own tensor).

A decode step multiplies a few rows (one token per sample) by every weight: the time goes to streaming the weights
through the cores. Handed a plain (out, in) weight, MKL's sgemm lays each block of it out for its kernel again at every
call; packed once into that layout (MKL's packed sgemm, what inductor's frozen graphs call), a step reads it as is. On
SmolLM2-135M in fp32 (30 layers, 2 Xeon cores) a decode step of 8 rows took 88 -> 72 ms eagerly and 77 -> 63 ms
compiled, 32 rows 121 -> 106 ms; packing it all anew takes ~0.15 s (bench/RESULTS.md). bf16 weights are not packed:
oneDNN's packed bf16 matmuls gained nothing measurable under autocast. The packed copy is held beside the weights (as
many bytes again: Engine.kept_bytes counts it; memory.py, which sizes GPU runs, does not) and packed anew only when a
weight has changed since (its in-place version counter: an optimizer step, a load) or the engine decodes another
number of rows (MKL packs for one row count and falls back to the plain weight at any other, as a prefill's rows are).
In GRPO on SmolLM2 (1 prompt x 8 samples x 32 tokens, fp32) decoding took 2.9 -> 2.3 s a step and the step 1.58 ->
1.77 completions/s (medians of 3, alternating).
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from nanochat_ext.backbone import Backbone, matmul_params


@torch.library.custom_op("nanochat_ext::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  rows: int) -> torch.Tensor:
    """x @ weight.T + bias from `packed` (packed for `rows` rows). One opaque op, so torch.compile calls it as it
    is: inductor's own lowering of the MKL call takes the weight for a frozen constant."""
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)


@packed_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
      rows: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.size(0)))


def packing_pays(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decoding from weights of `dtype` on `device` packs them: fp32 on a CPU, where this torch has MKL."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkl.is_available()


class PackedLinear(nn.Module):
    """nn.Linear's forward over fp32 `weight` and `bias` (shared, not copied), computed from a packed copy of the
    weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.register_buffer("packed", None, persistent=False)
        self.rows = 0
        self._packed_from: tuple[int, int] | None = None  # (weight's version, rows) the packed copy holds

    def repack(self, rows: int) -> None:
        key = (self.weight._version, rows)
        if key == self._packed_from:
            return
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight.detach(), rows)
        self.rows, self._packed_from = rows, key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.weight, self.bias, self.rows)


def packed_copy(decoder: Backbone) -> Backbone:
    """A copy of a native decoder sharing every tensor, each linear layer a PackedLinear over its weights; the LM head
    too where it is tied to the embedding (a lookup reads the embedding, the head streams it: both stay one tensor).
    Call repack(copy, rows) before each decode."""
    packed = copy_sharing(decoder, {id(t): t for t in [*decoder.parameters(), *decoder.buffers()]})
    for parent in list(packed.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child.weight, child.bias))
    model = packed.model
    if getattr(model, "lm_head", False) is None:  # a tied Llama: Llama.logits takes an lm_head module when it has one
        model.lm_head = PackedLinear(model.embed.weight, None)
    return packed


def repack(decoder: Backbone, rows: int) -> None:
    """Pack every weight of a packed_copy that changed since it was last packed, for `rows` rows."""
    for m in decoder.modules():
        if isinstance(m, PackedLinear):
            m.repack(rows)


def copy_sharing(model: Backbone, memo: dict[int, torch.Tensor]) -> Backbone:
    """copy.deepcopy(model) taking memo's tensors as they are, each block's own forward restored: a forward set on the
    instance (compiled, checkpointed) would call the original's, which runs the original's weights."""
    copied = copy.deepcopy(model, memo=memo)
    for m in copied.modules():
        if getattr(m.__dict__.get("forward"), "wraps_block", False):
            del m.forward
    return copied


def lowered_copy(model: Backbone, masters: list[nn.Parameter], dtype: torch.dtype
                 ) -> tuple[Backbone, list[tuple[str, torch.Tensor]]]:
    """A copy of model sharing every tensor but `masters`, which it holds in dtype; with (master's name, copy)
    pairs."""
    lowering = {id(p) for p in masters}
    memo = {id(t): t for t in [*model.parameters(), *model.buffers()] if id(t) not in lowering}
    memo.update({id(p): nn.Parameter(p.detach().to(dtype), requires_grad=False) for p in masters})  # no fp32 copy
    pairs = [(name, memo[id(p)]) for name, p in model.named_parameters() if id(p) in lowering]
    return copy_sharing(model, memo).eval(), pairs


def weight_bytes(decoder: Backbone) -> int:
    """Bytes of matmul weights a decode step reads (embeddings are read by the row, and not counted)."""
    return sum(p.numel() * p.element_size() for p in matmul_params(decoder))
