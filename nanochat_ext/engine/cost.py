"""What a decode step must read, as nanochat's scripts/infer_bench.py counts it: the matmul weights in the dtype decoded
from and each row's keys and values at its context; the device's peak memory bandwidth, the denominator of decode MBU;
and whether a run decodes enough to pay back compiling the decode step (--compile auto).
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass

import torch
import torch.nn as nn

from nanochat_ext.engine.packed import PackedLinear
from nanochat_ext.models.backbone import Backbone

# Peak memory bandwidth in bytes/s by device name, the most specific first (nanochat's figures, common.py). A
# GH200 is not an H200 (its memory varies by model): unknown.
PEAK_BANDWIDTH = ((("gh200",), None), (("h200",), 4.8e12), (("h100", "nvl"), 3.9e12), (("h100", "pcie"), 2.0e12),
                  (("h100",), 3.35e12), (("b200",), 8.0e12), (("a100",), 2.0e12), (("l40s",), 864e9),
                  (("a10g",), 600e9), (("4090",), 1.01e12), (("3090",), 936e9))


def peak_bandwidth(device: torch.device) -> float | None:
    """The device's peak memory bandwidth (bytes/s) where it is known here: the denominator of decode MBU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    return next((bw for keys, bw in PEAK_BANDWIDTH if all(k in name for k in keys)), None)


@dataclass
class DecodeStats:
    """One generate call, as nanochat's scripts/infer_bench.py reports decoding: decode steps after the prefill,
    the bytes each step must read (every matmul weight in the dtype decoded from, and each row's keys and values
    at its context, sliding windows counted by their width; a compiled step reads its length bucket, up to twice
    that: scheduler.read_length), and the seconds they took. steps: forward passes after the prefill (the compiled path
    counts the one after a token that stopped every row, which eager skips). row_steps: the rows each step decoded,
    summed (rows x steps but where eager decoding dropped the rows that had stopped, or compiled decoding moved the live
    ones into a smaller state)."""
    rows: int
    steps: int
    prefill_s: float
    decode_s: float
    weight_bytes: int  # per step
    kv_bytes: float  # per row and step, at the call's middle context
    row_steps: int

    @property
    def bytes_read(self) -> float:
        """Over all steps."""
        return self.steps * self.weight_bytes + self.row_steps * self.kv_bytes


def weight_bytes(decoder: Backbone) -> int:
    """Bytes of the matrices a decode step multiplies: every linear layer's (packed or not), and an LM head tied to the
    embedding, which the logits read whole (an embedding read by the row is not counted)."""
    held = {}
    for m in decoder.model.modules():
        if isinstance(m, (nn.Linear, PackedLinear)):
            held.update((id(p), p) for p in (m.weight, m.bias) if p is not None)
    model = decoder.model
    if decoder.native and getattr(model, "lm_head", False) is None and hasattr(model, "embed"):
        held[id(model.embed.weight)] = model.embed.weight
    return sum(p.numel() * p.element_size() for p in held.values())


def kv_bytes(decoder: Backbone, context: float) -> float:
    """Bytes of keys and values one row's decode step reads at this context (a sliding window reads its width),
    held in the autocast dtype where there is one (as KVCache holds them), else the weights'."""
    c, device = decoder.model.config, next(decoder.parameters()).device
    itemsize = (torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type)
                else next(decoder.parameters()).dtype).itemsize
    if decoder.native:
        heads, head_dim = c.n_kv_head, getattr(c, "head_dim", None) or c.n_embd // c.n_head
        windows = decoder.model.window_sizes
    else:
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        windows = [context] * c.num_hidden_layers
    return sum(2 * heads * head_dim * itemsize * min(context, w) for w in windows)


# --compile auto, on CPU: the cold compiles (training's batch shape, ~18 s, and evaluation's) cost ~30 s
# in a measured run and save 0.4-0.55 ms per decoded token step (2-core CPU, the bench's 4-layer Llama):
# break-even at 55-75k token steps (bench/RESULTS.md). Both scale with the number of layers, so the
# ratio holds for deeper models.
COMPILE_PAYS_AFTER = 100_000  # max_steps x max_new_tokens
# On CUDA: the CUDA-graph step decoded nanochat's d12 at 146.9k tokens/s against eager's 25.0k (256 rows, bf16, an
# H200; bench/RESULTS.md, the CUDA-graph decode of the first H200 sitting), 1.7 against 10.2 ms a token step, after a
# compile of under a minute: it pays back after ~7k token steps at that batch. Measured at that one batch; an eager
# step of fewer rows is expected to cost about as much (its kernels' launches, not its bytes, bound it), so the saving
# to hold.
COMPILE_PAYS_AFTER_CUDA = 10_000


def decode_compiled(flag: str, device: torch.device, max_steps: int, max_new_tokens: int) -> tuple[bool, str]:
    """--compile for the engine: '1' and '0' as asked; 'auto' compiles the decode step when the run decodes enough
    token steps to pay back the compile (on CPU also only where inductor's C++ compiler is there).
    Returns (compile, why) for the log."""
    if flag in ("0", "1"):
        return flag == "1", f"--compile {flag}"
    if flag != "auto":
        raise ValueError(f"--compile must be auto, 0 or 1, got {flag!r}")
    token_steps = max_steps * max_new_tokens
    pays_after = {"cpu": COMPILE_PAYS_AFTER, "cuda": COMPILE_PAYS_AFTER_CUDA}.get(device.type)
    if pays_after is None:
        return False, f"auto: on {device.type} the compiled step is not measured; --compile 1 to use it"
    if token_steps < pays_after:
        return False, (f"auto: {max_steps} steps x {max_new_tokens} tokens = {token_steps} token steps "
                       f"would not pay back the compile (< {pays_after})")
    if device.type == "cuda":
        return True, (f"auto: {max_steps} steps x {max_new_tokens} tokens = {token_steps} token steps pay back the "
                      f"compile (CUDA graphs, measured 5.9x eager's tokens/s at d12)")
    from torch._inductor import config as inductor

    cxx = inductor.cpp.cxx  # what inductor will try: $CXX, else g++ (clang++ on macOS)
    names = [c for c in (cxx if isinstance(cxx, (list, tuple)) else [cxx]) if c]
    if not any(shutil.which(c) for c in names):
        return False, f"auto: no C++ compiler ({' or '.join(names)}) for inductor"
    return True, f"auto: {max_steps} steps x {max_new_tokens} tokens = {token_steps} token steps pay back the compile"
