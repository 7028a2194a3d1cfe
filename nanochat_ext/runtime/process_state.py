"""What a run sets process-wide, put back as it was when the run ends, so that a caller's process (a notebook, a
script of its own: nanochat_ext.api) holds what it held before the call, and a second call with the same arguments
trains the same weights, bitwise, whatever ran before it: the random generators the run seeds (Python's, NumPy's,
torch's CPU ones, and the CUDA ones where CUDA was in use before the call: a run that starts CUDA leaves them seeded
by its seed), TF32 matmuls (precision.py turns them on on CUDA; written back only where the run changed them, as
torch refuses a mix of its legacy and new precision settings) and dynamo's recompile limit (models/compiled.py raises
it; back to torch's default where dynamo was not imported before). The rendezvous variables are
ddp_common.dist_session's to put back.
"""
from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator

import numpy as np
import torch


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """Run the body; then the process-wide settings above are what they were before it, whatever way it ends."""
    rngs = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda_rngs = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # never initialise CUDA here
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    dynamo = sys.modules.get("torch._dynamo")  # imported by a compile, or not yet
    limit = dynamo.config.recompile_limit if dynamo is not None else None
    try:
        yield
    finally:
        random.setstate(rngs[0])
        np.random.set_state(rngs[1])
        torch.set_rng_state(rngs[2])
        if cuda_rngs is not None:
            torch.cuda.set_rng_state_all(cuda_rngs)
        if (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) != tf32:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        if (dynamo := sys.modules.get("torch._dynamo")) is not None:
            dynamo.config.recompile_limit = limit if limit is not None else \
                dynamo.config._config["recompile_limit"].default
