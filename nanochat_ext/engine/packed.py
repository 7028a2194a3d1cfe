"""A decode step's matmuls at the memory's pace on a CPU: the engine decodes from a copy of the policy whose linear
layers hold their weights packed into oneDNN's blocked layout, packed again from the policy's current weights at every
generate call. At a few rows a decode step is the weights streamed from memory once; F.linear reads the plain weights
through a GEMM made for many rows, and oneDNN's GEMM reads its packed layout up to 2.5x faster (SmolLM2-135M's matmuls
at 8 rows on 2 AVX2 cores: the LM head 3.2 -> 8.0 GB/s, gate/up 4.8 -> 7.8; bench/roofline.py, bench/RESULTS.md).

The packed matmul is the same function as F.linear up to the GEMM's rounding (a row's output depends on its own input
alone, as F.linear's does), so the tokens are the plain engine's up to float ties, and the engine's log-probs differ
from the trainer's by rounding (train/engine_ratio). Eager and compiled decoding call the same packed op (a custom op,
which inductor calls as it is), so they stay bitwise equal. CPU only: a GPU's GEMM reads plain weights at its
bandwidth already.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from nanochat_ext.models.backbone import Backbone, shared_copy

# A step whose matmul weights are smaller than this stays in the caches between steps: nothing to stream, and packing
# measured no faster there (the tests' 4-layer models; bench/RESULTS.md)
PACK_FROM_BYTES = 32 * 2 ** 20


@torch.library.custom_op("nanochat_ext::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


class PackedLinear(nn.Module):
    """nn.Linear's forward over a packed copy of `weight` (the policy's own tensor, which it repacks from); the bias
    is the policy's own."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight, self.bias, self.out_features = weight, bias, weight.size(0)
        self.packed: torch.Tensor | None = None

    def pack(self, rows: int) -> None:
        """Pack the weight as it is now, for a GEMM of about `rows` rows (oneDNN picks its blocking by them)."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the custom op, which inductor calls as it is
            return packed_linear(x, self.packed, self.bias, self.out_features)
        # eager: the op itself (the custom op's dispatch cost ~75 us a call, 8% of a SmolLM2 step)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def packs(decoder: Backbone, device: torch.device) -> bool:
    """Whether decoding from packed weights pays here: our own models (LoRA's adapters decode plain: peft's layers
    wrap the linear ones) on a CPU with oneDNN, fp32 weights (oneDNN's bf16 GEMM needs a CPU that computes bf16),
    and a step too large for the caches."""
    modules = list(decoder.model.modules())
    weights = [m.weight for m in modules if isinstance(m, nn.Linear)]
    return (device.type == "cpu" and decoder.native and torch.backends.mkldnn.is_available()
            and not any(type(m).__module__.startswith("peft.") for m in modules)
            and all(w.dtype == torch.float32 for w in weights)
            and sum(w.numel() * w.element_size() for w in weights) >= PACK_FROM_BYTES)


class PackedCopy:
    """A decoder's copy whose linear layers are PackedLinear over its own weights (every other tensor shared), and the
    LM head of a model whose head is its embedding packed too (it is the step's largest matmul). `packed(rows)`
    packs every weight from the decoder's current values and returns the copy; `release()` frees the packed weights
    once the call has decoded."""

    def __init__(self, decoder: Backbone):
        self.source, self.copy = decoder, shared_copy(decoder)
        self.layers: list[PackedLinear] = []
        for parent in list(self.copy.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    layer = PackedLinear(child.weight, child.bias)
                    setattr(parent, name, layer)
                    self.layers.append(layer)
        model = self.copy.model
        if getattr(model, "lm_head", False) is None and hasattr(model, "embed"):  # a head tied to the embedding
            model.lm_head = PackedLinear(model.embed.weight, None)
            self.layers.append(model.lm_head)

    def packed(self, rows: int) -> Backbone:
        for layer in self.layers:
            layer.pack(rows)
        return self.copy

    def release(self) -> None:
        """Free the packed weights (a call's own: the next call packs its own again), so training never holds them."""
        for layer in self.layers:
            layer.packed = None

    def packed_bytes(self) -> int:
        """The packed weights held now (during a call)."""
        return sum(layer.weight.numel() * layer.weight.element_size() for layer in self.layers
                   if layer.packed is not None)
