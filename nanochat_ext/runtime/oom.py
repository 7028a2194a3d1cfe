"""Out of memory is bad input too (a model or batch too big for the device): the one line a run that does not fit ends
with, naming the phase it ran out in (runtime/progress.py), what was allocating, the peak, and the flags of this run
that take less memory there.
"""
from __future__ import annotations

import re

import torch

from nanochat_ext.runtime.progress import Phase

GiB = 2**30
FEWER_RANKS_STATE = "--parallel fsdp (weights, gradients and optimizer state sharded over the GPUs)"
LORA_STATE = "--lora_r 16 (LoRA: gradients and optimizer state for the adapters only)"
ANY_PHASE = ("a smaller --device_batch_size", "--activation_checkpointing", FEWER_RANKS_STATE)


def smaller_micro(micro: int, share: int) -> tuple[str, ...]:
    """The --device_batch_size hint for a phase of `micro` rows: the next size that divides the rank's share."""
    below = [m for m in range(micro - 1, 0, -1) if share % m == 0]
    return (f"--device_batch_size {below[0]}",) if below else ()


def is_out_of_memory(e: BaseException | None) -> bool:
    """torch's CUDA out-of-memory error, Python's MemoryError, CUDA's or the CPU allocator's failure as a RuntimeError,
    or an error raised from one of these."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (torch.OutOfMemoryError, MemoryError)) or (isinstance(e, RuntimeError) and any(
                s in str(e) for s in ("DefaultCPUAllocator: can't allocate memory", "CUDA error: out of memory"))):
            return True
        e = e.__cause__ or e.__context__
    return False


def out_of_memory_line(e: BaseException, phase: Phase | None, given: dict) -> str:
    """One line for an out-of-memory error: in which phase (None: outside every named one) and what was allocating,
    the peak, and the flags that take less memory there but those `given` already has on (flag -> value; a flag the
    script lacks is never suggested)."""
    asked = re.search(r"Tried to allocate [0-9.]+ [KMGT]?i?B", str(e))
    what, hints, saved = phase or Phase("", ANY_PHASE)
    peak = ""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()
        total = torch.cuda.get_device_properties(device).total_memory / GiB
        peak = f"; peak {torch.cuda.max_memory_allocated(device) / GiB:.1f} of {total:.1f} GiB on this GPU"
    lora = bool(given.get("lora_r", 0))  # fsdp is not offered beside LoRA (LoraConfig.spec)
    on = {"--activation_checkpointing": given.get("activation_checkpointing", True),
          "--parallel fsdp": given.get("parallel", "fsdp") == "fsdp" or lora,
          "--lora_r": lora or "lora_r" not in given}
    flags = [h for h in hints if not any(h.startswith(flag) and is_on for flag, is_on in on.items())]
    resume = "" if not what else "; this step's checkpoint is saved" if saved else \
        "; nothing was saved for this step: resume from the last checkpoint with --resume latest"
    return (f"out of memory{' in ' + what if what else ''} ({asked.group(0) if asked else type(e).__name__}{peak}); "
            f"to take less: {', '.join(flags) or 'a smaller model or a larger GPU'}{resume}")
