"""--compile for every model that trains or scores: each transformer block's forward under torch.compile
(regional compilation), for the calls that run without a KV cache (training, log-probs, the reference, RM
scores, evaluation). Decoding keeps its own path (engine.py).

Per block rather than the whole model: the blocks are the compute, their inputs are plain tensors, and the
code around them (masks, prefix trees, chunked LM head) would otherwise break graphs or recompile. Blocks of one
kind share graphs (torch inlines nn.Modules, so parameters are graph inputs). Shapes: torch's default
(dynamic=None) compiles a block static first and, at the first new length or batch, once more with symbolic
sizes; ragged micro-batches then reuse that graph, and the log's graph count stops growing after warm-up.
The LM head's log-prob chain, between the blocks and the loss, is compiled apart with symbolic sizes
(logprobs.chunk_logprobs_fn): its chunks' row counts vary at every call.
"""
from __future__ import annotations

import sys

import torch

from nanochat_ext.backbone import Backbone

# Graphs per code object before torch gives up compiling it: every block of a model shares Block.forward,
# and a GRPO run needs ~15 of them (with/without value embeddings, causal/windowed/tree masks, the scored
# last block, grad and no-grad, static then symbolic shapes), and the engine's decode step one per batch shape
# and sampling setting. At torch's default of 8 the rest would fall back to eager without a word.
RECOMPILE_LIMIT = 64


def blocks_compiled(flag: str, device: torch.device) -> tuple[bool, str]:
    """--compile for the blocks: '1' and '0' as asked; 'auto' compiles on CUDA (an H100 RM step ran 1.7-1.8x
    faster, ../shared/gpu-baseline) and not on CPU, where no bench has shown the compile paying back.
    Returns (compile, why) for the log."""
    if flag not in ("auto", "0", "1"):
        raise ValueError(f"--compile must be auto, 0 or 1, got {flag!r}")
    if flag != "auto":
        return flag == "1", f"--compile {flag}"
    if device.type == "cuda":
        return True, "auto: on cuda"
    return False, f"auto: on {device.type} a compiled block is not measured to pay back its compile"


def compile_blocks(backbone: Backbone, backend: str = "inductor") -> bool:
    """Put each block of one of our models (nanochat GPT, native Llama) under torch.compile for calls without a
    KV cache; returns False, leaving it eager, for a transformers module. backend: torch.compile's (the tests
    use aot_eager where only dynamo's graphs and guards are under test)."""
    if not backbone.native:
        return False
    allow_recompiles()
    for block in backbone.blocks:
        block.forward = _without_cache(block.forward, torch.compile(block.forward, backend=backend))
    backbone.compiled = backend  # the LM head's log-prob chain too (logprobs.chunk_logprobs_fn)
    return True


def allow_recompiles() -> None:
    """Raise torch's graphs-per-function limit to RECOMPILE_LIMIT (see there)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)


def _without_cache(eager, compiled):
    """The compiled forward, except for calls with a KV cache (a prefill or an eager decode step), whose
    position counter would be a new graph at every token."""
    def forward(*args, kv_cache=None, **kwargs):
        if kv_cache is not None:
            return eager(*args, kv_cache=kv_cache, **kwargs)
        return compiled(*args, **kwargs)

    forward.wraps_block = True  # engine.lowered_copy drops it from its copy, which must run its own weights
    return forward


def compile_models(flag: str, device: torch.device, *backbones: Backbone | None) -> str:
    """Apply --compile to every backbone given (None: absent, e.g. no reference at beta 0); returns the log
    line that says what runs compiled and why."""
    use, why = blocks_compiled(flag, device)
    if not use:
        return f"compile: blocks eager ({why})"
    eager = [b.source for b in backbones if b is not None and not compile_blocks(b)]
    tail = f"; eager: {', '.join(eager)} (a transformers module)" if eager else ""
    return f"compile: blocks compiled ({why}){tail}"


def compile_stats() -> tuple[int, float]:
    """(graphs compiled, seconds spent compiling them) in this process so far, from torch's own counters."""
    if "torch._dynamo" not in sys.modules:  # nothing compiled yet (importing dynamo alone takes ~1.5 s)
        return 0, 0.0
    from torch._dynamo.utils import compilation_time_metrics, counters

    return (int(counters["stats"]["unique_graphs"]),
            float(sum(compilation_time_metrics.get("_compile.compile_inner", []))))
