"""The optimizer the trainers build, against torch's reference implementation."""
import torch

from nanochat_ext.optim import make_adamw


def test_cpu_adamw_is_fused_and_steps_like_the_reference():
    """make_adamw takes torch's fused kernel on CPU; over 20 steps with weight decay, on tensors of odd
    sizes, it moves the weights as the reference one-tensor-at-a-time AdamW does (to float rounding)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(33, 7), (5,), (128, 64)]
    start = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(20)]
    fused = [torch.nn.Parameter(t.clone()) for t in start]
    ref = [torch.nn.Parameter(t.clone()) for t in start]
    opt = make_adamw(fused, 1e-2, 0.1, torch.device("cpu"))
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    assert opt.defaults["fused"]
    for step_grads in grads:
        for params, o in ((fused, opt), (ref, ref_opt)):
            for p, grad in zip(params, step_grads):
                p.grad = grad.clone()
            o.step()
    for a, b, s in zip(fused, ref, start):
        assert not torch.allclose(a, s, atol=0.05)  # the steps moved the weights
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
