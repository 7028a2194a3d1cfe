"""nanochat's optimizer, MuonAdamW (karpathy/nanochat 92d63d4, nanochat/optim.py), written here from its algorithm:
AdamW on the groups of kind 'adamw' (embeddings, LM head, scalars) and nanochat's Muon on the groups of kind 'muon'
(the transformer blocks' matrices, one group per shape so a group's matrices step as one stack):

  Nesterov momentum -> MuonEq row equilibration -> Polar Express orthogonalisation (5 iterations) -> Muon+
  renormalisation to sqrt(min(rows, cols)) -> NorMuon's factored second moment (beta2) -> cautious weight decay,
  at lr x max(1, rows / cols)^1/2.

Every hyperparameter is rounded to float32 and combined in float32 (1 - beta, lr x wd, the bias corrections), as
nanochat holds them in 0-D float32 tensors. The orthogonalisation runs in bfloat16 on a CUDA GPU that has it (SM 8.0
and later) and in float32 elsewhere, nanochat's COMPUTE_DTYPE; everything else in the parameters' dtype.

nanochat syncs gradients inside its optimizer and shards the state over ranks; here DDP has averaged the gradients
before the step and every rank takes the same whole step, so the numbers are one rank's on any number of ranks."""
from __future__ import annotations

import torch

from nanochat_ext.errors import InputError

# Polar Express (Amsel et al. 2025, arXiv 2505.16932) for 5 iterations, safety factor 2e-2, cushion 2: nanochat's
# (a, b, c) per iteration of X <- a X + (b A + c A^2) X, A = X X^T.
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def f32(x: float | torch.Tensor) -> torch.Tensor:
    """A hyperparameter as nanochat holds it: a 0-D float32 tensor, so arithmetic on it rounds as nanochat's does."""
    return torch.as_tensor(x, dtype=torch.float32)


def orthogonalise_dtype(device: torch.device) -> torch.dtype:
    """nanochat's COMPUTE_DTYPE for the orthogonalisation: bf16 on a CUDA GPU with bf16 (SM 8.0+), else fp32."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8:
        return torch.bfloat16
    return torch.float32


def adamw_update(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int,
                 lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """nanochat's AdamW step, in place, in fp32: decoupled decay first, then Adam with bias correction and eps added
    to sqrt(v / (1 - beta2^t)). torch's AdamW adds eps to sqrt(v) / sqrt(1 - beta2^t) and keeps its betas in double:
    the same step to a few float roundings."""
    lr_t, beta1, beta2, step_t = f32(lr), f32(betas[0]), f32(betas[1]), f32(step)
    p32, m32, v32, g32 = p.float(), exp_avg.float(), exp_avg_sq.float(), grad.float()
    p32.mul_((1 - lr_t * f32(weight_decay)).item())
    m32.lerp_(g32, (1 - beta1).item())
    v32.lerp_(g32.square(), (1 - beta2).item())
    bias1, bias2 = 1 - beta1 ** step_t, 1 - beta2 ** step_t
    denom = (v32 / bias2.item()).sqrt() + f32(eps).item()
    p32.add_(m32 / denom, alpha=-(lr_t / bias1).item())
    for stored, computed in ((p, p32), (exp_avg, m32), (exp_avg_sq, v32)):
        if stored is not computed:  # a bf16 tensor: computed in fp32, stored back
            stored.copy_(computed)


def polar_express(g: torch.Tensor, dtype: torch.dtype, steps: int) -> torch.Tensor:
    """The nearest (semi-)orthogonal matrix to each matrix of the stack g (..., rows, cols), in `dtype`. MuonEq first
    rescales every row to the mean row norm, which conditions the spectrum the iteration starts from; the stack is
    then scaled inside the unit ball (x 1.01 for safety) and iterated on its shorter side's Gram matrix."""
    x = g.to(dtype)
    mean_row_norm = x.float().norm(dim=(-2, -1), keepdim=True) / (x.size(-2) ** 0.5)
    row_norm = x.float().norm(dim=-1, keepdim=True).clamp_min(1e-6)
    x = x * (mean_row_norm / row_norm).to(dtype)
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * 1.01 + 1e-6)
    tall = g.size(-2) > g.size(-1)
    for a, b, c in POLAR_EXPRESS[:steps]:
        gram = x.mT @ x if tall else x @ x.mT
        poly = b * gram + c * (gram @ gram)
        x = a * x + (x @ poly if tall else poly @ x)
    return x


def muon_update(params: torch.Tensor, grads: torch.Tensor, momentum_buffer: torch.Tensor,
                second_moment: torch.Tensor, *, lr: float, weight_decay: float, momentum: float, beta2: float,
                ns_steps: int, dtype: torch.dtype) -> None:
    """nanochat's Muon step on a stack of same-shape matrices (k, rows, cols), in place on params and both buffers
    (grads is used as scratch). second_moment is (k, rows, 1) for rows >= cols, else (k, 1, cols): one entry per
    row or column of the longer side, the mean square over the other."""
    momentum_t = f32(momentum).to(grads.dtype)
    momentum_buffer.lerp_(grads, (1 - momentum_t).item())
    update = grads.lerp_(momentum_buffer, momentum_t.item())  # Nesterov: the gradient pulled toward the momentum
    update = polar_express(update, dtype, ns_steps).to(params.dtype)

    # Muon+: the iteration stops short of orthogonal; set the norm an exactly semi-orthogonal matrix has
    norm = update.float().norm(dim=(-2, -1), keepdim=True).clamp_min(1e-6)
    update = update * (min(update.size(-2), update.size(-1)) ** 0.5 / norm).to(update.dtype)

    # NorMuon: scale each row (column) by its running rms^-1, then restore the matrix's norm from before
    reduce = -1 if update.size(-2) >= update.size(-1) else -2
    width = update.size(reduce)
    mean_sq = update.float().square().mean(dim=reduce, keepdim=True)
    norm_before = (mean_sq.sum(dim=(-2, -1), keepdim=True) * width).sqrt()
    second_moment.lerp_(mean_sq.to(second_moment.dtype), (1 - f32(beta2).to(update.dtype)).item())
    inv_rms = second_moment.clamp_min(1e-10).rsqrt()
    norm_after = ((mean_sq * width) * inv_rms.float().square()).sum(dim=(-2, -1), keepdim=True).sqrt()
    update = update * (inv_rms * (norm_before / norm_after.clamp_min(1e-10))).to(update.dtype)

    # Cautious weight decay: only where the update already pulls the weight toward zero
    lr_t = f32(lr)
    toward_zero = (update * params) >= 0
    params.sub_(lr_t.item() * update + (lr_t * f32(weight_decay)).item() * params * toward_zero)


class MuonAdamW(torch.optim.Optimizer):
    """nanochat's MuonAdamW: param groups of kind 'adamw' (lr, betas, eps, weight_decay) or 'muon' (lr, momentum,
    ns_steps, beta2, weight_decay; all matrices of one shape). A parameter without a gradient is left as it is
    (in a Muon group: all of them or none).
    State: per AdamW parameter step, exp_avg, exp_avg_sq; per Muon group, on its first parameter, the stacked
    momentum_buffer and second_momentum_buffer."""

    def __init__(self, param_groups: list[dict], orthogonalise_in: torch.dtype):
        super().__init__(param_groups, defaults={})
        for group in self.param_groups:
            shapes = {p.shape for p in group["params"]}
            if group["kind"] == "muon" and (len(shapes) != 1 or len(next(iter(shapes))) != 2):
                raise ValueError(f"a muon group holds matrices of one shape, not {sorted(shapes)}")
        self.orthogonalise_in = orthogonalise_in

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            if group["kind"] == "adamw":
                self.adamw_step(group)
            else:
                with torch.autocast(group["params"][0].device.type, enabled=False):  # dtypes are chosen here
                    self.muon_step(group)

    def adamw_step(self, group: dict) -> None:
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            state["step"] += 1
            adamw_update(p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"], group["lr"],
                         group["betas"], group["eps"], group["weight_decay"])

    def muon_step(self, group: dict) -> None:
        params = group["params"]
        with_grad = sum(p.grad is not None for p in params)
        if with_grad == 0:
            return
        if with_grad < len(params):  # the stacked state has no room to leave one out: never so under GRPO
            raise ValueError(f"{len(params) - with_grad} of a Muon group's {len(params)} matrices got no gradient")
        state = self.state[params[0]]
        rows, cols = params[0].shape
        if not state:
            like = dict(dtype=params[0].dtype, device=params[0].device)
            state["momentum_buffer"] = torch.zeros(len(params), rows, cols, **like)
            factored = (len(params), rows, 1) if rows >= cols else (len(params), 1, cols)
            state["second_momentum_buffer"] = torch.zeros(factored, **like)
        stack = torch.stack(params)
        muon_update(stack, torch.stack([p.grad for p in params]), state["momentum_buffer"],
                    state["second_momentum_buffer"], lr=group["lr"] * max(1.0, rows / cols) ** 0.5,
                    weight_decay=group["weight_decay"], momentum=group["momentum"], beta2=group["beta2"],
                    ns_steps=group["ns_steps"], dtype=self.orthogonalise_in)
        torch._foreach_copy_(params, list(stack.unbind(0)))

    def load_state_dict(self, state_dict: dict) -> None:
        """A state saved by this optimizer only: --optimizer muon's earlier state (torch.optim.Muon + AdamW, saved
        as {'adamw', 'muon'}) holds another algorithm's moments, which cannot continue here."""
        if set(state_dict) == {"adamw", "muon"}:
            raise InputError("the checkpoint's optimizer state is the earlier --optimizer muon's (torch.optim.Muon "
                             "+ AdamW): nanochat's MuonAdamW cannot continue another algorithm's state; start a new "
                             "run from its weights (--policy the checkpoint) instead of --resume")
        kinds = [g.get("kind") for g in state_dict.get("param_groups", [])]
        if kinds != [g["kind"] for g in self.param_groups]:
            raise InputError(f"the checkpoint's optimizer state has groups {kinds}, not nanochat's MuonAdamW's "
                             f"{[g['kind'] for g in self.param_groups]} for this policy")
        super().load_state_dict(state_dict)
