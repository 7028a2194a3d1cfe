"""--dtype: the compute dtype of the matmuls and the autocast context that computes in it (TF32 on CUDA)."""
from __future__ import annotations

import contextlib

import torch

DTYPES = ("auto", "float32", "bfloat16")


def compute_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The matmul dtype --dtype asks for: bf16 when given, or auto on CUDA; fp32 otherwise."""
    if dtype == "bfloat16" or (dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def precision(dtype: torch.dtype, device: torch.device) -> contextlib.AbstractContextManager:
    """The autocast context for a compute dtype (see compute_dtype): bf16 autocast, or none for fp32;
    TF32 matmuls on CUDA."""
    if device.type == "cuda" and not (torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32):
        # written only where off: a caller's torch.set_float32_matmul_precision, written beside the legacy flags,
        # would make torch refuse to read its precision back
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
