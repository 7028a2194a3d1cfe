"""What a transformers causal LM's own forward does between its final hidden states and the logits it returns, found
by running that forward, so that logits computed from hidden states in chunks (logprobs.py) are the model's own.

Many architectures change the LM head's output: Gemma-2 and transformers' nanochat cap it (c * tanh(x / c)), Cohere
multiplies it by `logit_scale`, Granite divides it by `logits_scaling`, and others scale the hidden states before the
head. Rather than keep a list of families and their config fields, `probe` runs the model's forward with the head's
output replaced by known values and reads off what the forward made of them: a scale, a cap, or both. A forward that
does something else (or never calls its output embeddings) is refused in one line: nothing runs on logits the model
would not give.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from nanochat_ext.errors import InputError

# The head outputs the probe feeds the forward: both signs, from where tanh is linear to where it saturates.
_GRID = torch.tensor([0.0, 1e-3, 0.1, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 50.0, 100.0, 300.0, 1e3, 1e4])
_FAR = 1e30  # a head output past any cap: the cap itself comes back


@dataclass(frozen=True)
class HeadTransform:
    """logits = cap * tanh(scale * head(h) / cap), or scale * head(h) without a cap."""
    scale: float = 1.0
    cap: float | None = None

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.cap is None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.cap is not None:
            logits = self.cap * torch.tanh(logits / self.cap)
        return logits

    def describe(self) -> str:
        parts = ([f"scaled by {self.scale:g}"] if self.scale != 1.0 else []) + \
                ([f"capped at {self.cap:g}"] if self.cap is not None else [])
        return " and ".join(parts) or "unchanged"


@torch.no_grad()
def probe(model: nn.Module, source: str) -> HeadTransform:
    """The transform model's forward applies after its output embeddings (and any constant scaling of the hidden
    states before them, folded into the scale where the head has no bias). model: a transformers causal LM."""
    head = model.get_output_embeddings()
    if head is None:
        raise InputError(f"{type(model).__name__} has no output embeddings to compute logits with", path=source)
    seen: dict[str, torch.Tensor] = {}
    device = head.weight.device

    def record_input(_module, args):
        seen["input"] = args[0].detach().clone()

    def replace_output(_module, _args, output):
        seen["called"] = torch.ones(())
        probe_values = _GRID.to(device=device, dtype=output.dtype)
        values = torch.cat([probe_values, -probe_values[1:], probe_values.new_tensor([_FAR, -_FAR])])
        flat = values.repeat(output.numel() // values.numel() + 1)[:output.numel()]
        seen["fed"] = flat.view_as(output).clone()
        return flat.view_as(output)

    length = max(1, -(-(_GRID.numel() * 2 + 1) // head.out_features))  # enough head outputs to hold the probe
    ids = torch.zeros(1, length + 1, dtype=torch.long, device=device)
    hooks = [head.register_forward_pre_hook(record_input), head.register_forward_hook(replace_output)]
    was_training = model.training
    model.eval()
    try:
        out = model(input_ids=ids, use_cache=False)
        hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    name = type(model).__name__
    if "called" not in seen:
        raise InputError(f"{name}'s forward does not compute its logits with its output embeddings, so they cannot "
                         f"be computed in chunks here", path=source)
    logits = getattr(out, "logits", None)
    if logits is None or logits.shape != seen["fed"].shape:
        raise InputError(f"{name}'s forward returns logits of another shape than its LM head's output", path=source)
    pre = _hidden_scale(seen["input"], hidden, _tolerance(hidden.dtype))
    if pre is None or (pre != 1.0 and getattr(head, "bias", None) is not None):
        raise InputError(f"{name}'s forward changes the hidden states between its base model and its LM head in a way "
                         f"this trainer cannot reproduce; it is not supported", path=source)
    fitted = _fit(seen["fed"].double().flatten(), logits.double().flatten(), _tolerance(logits.dtype))
    if fitted is None:
        raise InputError(f"{name}'s forward transforms its LM head's output in a way this trainer cannot reproduce "
                         f"per chunk (not a scale or a tanh cap); it is not supported", path=source)
    return HeadTransform(fitted.scale * pre, fitted.cap)


def _tolerance(dtype: torch.dtype) -> float:
    """How far the forward's own order of operations may round from ours: 1e-5 in fp32, 8 ulps in lower precisions."""
    return max(1e-5, 8 * torch.finfo(dtype).eps)


def _hidden_scale(fed: torch.Tensor, hidden: torch.Tensor, tol: float) -> float | None:
    """The constant c with fed == c * hidden (1.0 when they are equal), or None."""
    if fed.shape != hidden.shape:
        return None
    if torch.equal(fed, hidden):
        return 1.0
    big = hidden.abs() > 1e-3 * hidden.abs().max()
    c = float((fed[big] / hidden[big]).median())
    return c if torch.allclose(fed.double(), c * hidden.double(), rtol=tol, atol=0) else None


def _fit(x: torch.Tensor, y: torch.Tensor, tol: float) -> HeadTransform | None:
    """The scale and cap that map the fed head outputs x to the returned logits y, checked on every value."""
    far = x.abs() >= _FAR
    saturated = y[far & (x > 0)]
    if not saturated.numel():
        return None
    # A capped head output comes back as the cap itself; an uncapped one as the scaled _FAR (or inf).
    cap = float(saturated[0]) if abs(float(saturated[0])) < _FAR * 1e-6 else None
    one = x == 1.0
    if not one.any():
        return None
    y1 = float(y[one][0])
    if cap is not None and 0 < abs(y1) < cap:
        scale = cap * math.atanh(y1 / cap)
    else:
        scale = y1
    fitted = HeadTransform(scale=1.0 if abs(scale - 1.0) < tol else scale, cap=cap)
    near = ~far
    expected = fitted(x[near])
    width = max(1.0, float(expected.abs().max()))
    ok = bool(((expected - y[near]).abs() <= tol * width).all())
    if cap is not None:
        ok = ok and bool(torch.allclose(y[far], cap * torch.sign(x[far]), rtol=tol))
    return fitted if ok else None
