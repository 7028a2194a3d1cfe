"""--compile for every model that trains or scores: each transformer block's forward under torch.compile
(regional compilation), for the calls that run without a KV cache (training, log-probs, the reference, RM
scores, evaluation). Decoding keeps its own path (engine.py).

Per block rather than the whole model: the blocks are the compute, their inputs are plain tensors, and the
code around them (masks, prefix trees, chunked LM head) would otherwise break graphs or recompile. Blocks of one
kind share graphs (torch inlines nn.Modules, so parameters are graph inputs). Shapes are symbolic from the first
compile (dynamic=True): torch's default would compile each variant static first and again with symbolic sizes at
the first new length, twice the graphs for one steady state (a GRPO run's warm-up: 12 block graphs, 8 now). A
block's variants are what its guards tell apart: grad or not, value embeddings or not, the last block scored at
some positions or not. Ragged micro-batches reuse them, and the log's graph count stops growing after warm-up.
The LM head's log-prob chain, between the blocks and the loss, is compiled apart with symbolic sizes
(logprobs.chunk_logprobs_fn): its chunks' row counts vary at every call.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

from nanochat_ext.models.backbone import Backbone

# Graphs per code object before torch gives up compiling it: every block of a model shares Block.forward,
# and a GRPO run needs 8 or more of them (with/without value embeddings, the scored last block, grad and no-grad,
# more for other dtypes and size-1 batches), and the engine's decode step one per batch shape (each row count a call
# is compacted into too), sampling setting and length bucket: 64 rows compacted to 8 in a 2048-slot cache, sampled
# and greedy, is 4 x 4 x 2 = 32 graphs, the evaluation's row counts more. At torch's default of 8 the rest would fall
# back to eager; CompileLog says so where it happens.
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
        block.forward = _without_cache(block.forward, torch.compile(block.forward, backend=backend, dynamic=True))
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


COMPILE_HELP = ("1: torch.compile each transformer block of our models (nanochat GPT, native Llama) wherever they "
                "train or score, and the LM head's log-prob chain; the log says how many graphs and seconds that took. "
                "GRPO also decodes with a compiled static-shape step, sampling included (the same tokens as eager; "
                "~10-19 s to compile on a 2-core CPU, then ~1.6x faster there). auto: blocks compiled on CUDA, eager "
                "on CPU; GRPO's decode step compiled when a run's steps x new tokens a completion pay back its "
                "compile: >= 100000 on CPU, >= 10000 on CUDA (CUDA graphs: 5.9x eager's tokens/s at d12 on an H200)")


def compile_models(flag: str, device: torch.device, *backbones: Backbone | None) -> str:
    """Apply --compile to every backbone given (None: absent, e.g. no reference at beta 0); returns the log
    line that says what runs compiled and why."""
    use, why = blocks_compiled(flag, device)
    if not use:
        return f"compile: blocks eager ({why})"
    eager = [b.source for b in backbones if b is not None and not compile_blocks(b)]
    tail = f"; eager: {', '.join(eager)} (a transformers module)" if eager else ""
    return f"compile: blocks compiled ({why}){tail}"


class CompileLog:
    """torch's own record of every compile in this process (torch._dynamo.utils.get_compilation_metrics), one line
    per compile not yet reported: a function's first graph, a recompile with the guard that failed (what varied:
    a grad mode, an argument None or not, a size), a function left eager (past RECOMPILE_LIMIT, or a failure), and
    a graph CUDA graphs skipped (the engine's step on CUDA)."""

    def __init__(self):
        self._seen: list = []  # the records reported so far, kept so that their ids stay theirs
        self._functions: dict[str, str] = {}  # torch's frame id -> 'name (file:line)' (a refused compile has none)

    def new_lines(self) -> list[str]:
        if "torch._dynamo" not in sys.modules:
            return []
        from torch._dynamo.utils import get_compilation_metrics

        known = {id(m) for m in self._seen}
        lines = []
        for m in get_compilation_metrics():
            if id(m) in known:
                continue
            self._seen.append(m)
            frame = (m.compile_id or "?/").split("/")[0]
            if m.co_name:
                self._functions[frame] = f"{m.co_name} ({Path(m.co_filename or '?').name}:{m.co_firstlineno})"
            where = self._functions.get(frame, "a function")
            if m.fail_reason:
                lines.append(f"compile: {where} runs eager: {_first_line(m.fail_reason)}")
            elif m.recompile_reason:
                lines.append(f"compile: {where} recompiled: {_first_line(m.recompile_reason)}")
            else:
                lines.append(f"compile: {where} compiled")
            if m.cudagraph_skip_reason:
                lines.append(f"compile: {where} skips CUDA graphs: {_first_line(m.cudagraph_skip_reason)}")
        return lines


def _first_line(reason: str) -> str:
    """A reason's first line, without torch's graph id ('0/3: ') and the source comment it appends."""
    line = reason.strip().splitlines()[0]
    line = re.sub(r"^\d+/\d+: ", "", line).split("  #")[0]
    return " ".join(line.split())


def compile_stats() -> tuple[int, float]:
    """(graphs compiled, seconds spent compiling them) in this process so far, from torch's own counters."""
    if "torch._dynamo" not in sys.modules:  # nothing compiled yet (importing dynamo alone takes ~1.5 s)
        return 0, 0.0
    from torch._dynamo.utils import compilation_time_metrics, counters

    return (int(counters["stats"]["unique_graphs"]),
            float(sum(compilation_time_metrics.get("_compile.compile_inner", []))))
