"""What bench_gpu.py's measurements share: nanochat's shapes as random models, their FLOPs, and clocks.

Shapes: dN = nanochat's depth-N model: N layers, width 64*N rounded up to a multiple of 128, heads of
128, vocab 65536 (dN:V for another: d24:32768 is nanochat's speedrun model), context 2048.
Peak memory without a GPU: bench/memory_estimate.py.

FLOPs, in nanochat's convention (a (m x k)(k x n) matmul is 2mkn; attention counts its full key
range, no causal halving, a windowed layer its window). Per token of a T-token sequence, one forward
pass through blocks B costs
    fwd(B) = 2 * matmul_params(B) + 4 * sum over layers l in B of d_model * min(window_l, T)
and a backward pass twice that. So
    RM step   = tokens * (fwd(all blocks) + 2 * fwd(trainable blocks))   (no LM head; frozen blocks
                below the first trainable one need no backward at all)
    GRPO step = tokens * 3 * fwd(all blocks) + completion tokens * 6 * d_model * vocab   (LM head only
                at completion positions)
    DPO step  = computed tokens * 4 * fwd(all blocks) + response tokens * 8 * d_model * vocab   (the policy's
                forward and backward and the reference's forward; a pair's prompt computed once)
MFU = FLOPs / seconds / peak, the peak being the device's dense bf16 tensor-core rate (H100/H200 SXM:
989 TFLOP/s; --peak_tflops for another). Generation is memory-bound and is given in tokens/s only.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanochat_ext.engine.cost import peak_bandwidth
from nanochat_ext.models.backbone import Backbone
from nanochat_ext.models.gpt import GPT, GPTConfig, padded

PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0, "L40S": 362.1, "A10G": 70.0}


def nanochat_dims(name: str) -> tuple[int, int, int, int]:
    """(depth, model_dim, heads, vocab) of shape `name`: 'dN' or 'dN:VOCAB' (default vocab 65536, what the
    GPU baseline measured; nanochat's speedrun tokenizer has 32768: 'd24:32768'), by nanochat's own rule
    (scripts/base_train.py): model_dim = depth * 64 rounded up to a multiple of head_dim 128, heads of 128.
    'tiny': the CPU smoke test's."""
    if name == "tiny":
        return 2, 64, 4, 512
    depth, _, vocab = name.removeprefix("d").partition(":")
    depth = int(depth)
    model_dim = -(-depth * 64 // 128) * 128
    return depth, model_dim, model_dim // 128, int(vocab or 65536)


def shape_config(name: str, vintage: str = "current") -> GPTConfig:
    """nanochat's model of shape `name` (nanochat_dims) of that vintage. d20 is 561M parameters up to
    dec2025; today's value embeddings bring it to 1.40B."""
    depth, width, heads, vocab = nanochat_dims(name)
    if name == "tiny":
        return GPTConfig(sequence_len=256, vocab_size=vocab, n_layer=depth, n_head=heads, n_kv_head=heads,
                         n_embd=width, window_pattern="SL", vintage=vintage, padded_vocab_size=vocab)
    return GPTConfig(sequence_len=2048, vocab_size=vocab, n_layer=depth, n_head=heads, n_kv_head=heads,
                     n_embd=width, window_pattern="SSSL", vintage=vintage, padded_vocab_size=padded(vocab))


_INITIAL: dict[tuple[str, int], dict[str, torch.Tensor]] = {}  # (config, seed) -> weights drawn on CPU


def make_backbone(cfg: GPTConfig, device: torch.device, seed: int) -> Backbone:
    """A random model of that shape, its weights drawn once per (shape, seed) on CPU (init_weights' generator
    is a CPU one; drawing 1.4B of them takes long enough to matter in a 10-minute GPU call) and copied after."""
    key = (repr(cfg), seed)
    if key not in _INITIAL:
        model = GPT(cfg)
        model.init_weights(seed)
        _INITIAL[key] = model.state_dict()
    with torch.device(device):
        model = GPT(cfg)
    model.load_state_dict(_INITIAL[key])
    return Backbone("nanochat", model, f"random {cfg.n_layer}x{cfg.n_embd}").eval()


def block_fwd_flops(cfg: GPTConfig, blocks: list, T: int) -> float:
    """Forward FLOPs per token through `blocks` (see the module docstring)."""
    matmul = sum(p.numel() for b in blocks for p in b.parameters() if p.dim() == 2)
    windows = GPT._window_sizes(cfg)
    first = cfg.n_layer - len(blocks)
    return 2 * matmul + 4 * sum(cfg.n_embd * min(windows[first + i], T) for i in range(len(blocks)))


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


class Clock:
    """Wall time of a phase (synchronised on CUDA) and its peak allocated memory."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_gb = torch.cuda.max_memory_allocated(self.device) / 2**30
        else:
            self.peak_gb = None
        self.s = time.perf_counter() - self.t0


def autocast_for(device: torch.device) -> torch.autocast:
    return torch.autocast(device.type, dtype=torch.bfloat16)


def decode_figures(runs: list, device: torch.device) -> dict:
    """Decoding over the engine's timed calls, as nanochat's infer_bench reports it: rows x steps per second of
    decode steps, and MBU (the bytes those steps must read, over the device's peak bandwidth)."""
    s = sum(r.decode_s for r in runs)
    bw = peak_bandwidth(device)
    return {"decode_tok_per_s": round(sum(r.rows * r.steps for r in runs) / s, 1) if s > 0 else None,
            "decode_mbu": round(sum(r.bytes_read for r in runs) / s / bw, 4) if bw and s > 0 else None,
            "prefill_s": round(sum(r.prefill_s for r in runs) / len(runs), 4)}


