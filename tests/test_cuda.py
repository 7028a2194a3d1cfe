"""The CUDA path, run where a GPU is: `python -m pytest -m cuda` (skipped without one). One rank with
--backend nccl goes through the whole distributed code path (process group, DDP, every collective)."""
from __future__ import annotations

import json

import pytest
import torch
from test_pipeline import speedrun

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_pipeline_on_one_gpu_with_nccl(tmp_path):
    base = tmp_path / "base"
    proc = speedrun(base, NPROC_PER_NODE="1", BACKEND="nccl")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for stage in ("rm_uniform", "grpo_uniform"):
        logs = base / ("rm_checkpoints" if stage.startswith("rm") else "chatrl_checkpoints") / "uniform" / "logs"
        rows = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
        assert any(r.get("perf/max_mem_allocated_gb", 0) > 0 for r in rows), stage


def test_cuda_precision_rules(assets, tmp_path):
    """bf16 autocast, TF32, fused AdamW, and frozen weights held in bf16 on CUDA."""
    from nanochat_ext.models.backbone import hold_frozen_in
    from nanochat_ext.models.loader import load_backbone
    from nanochat_ext.runtime.precision import compute_dtype, precision
    from nanochat_ext.training.optim import make_adamw

    device = torch.device("cuda")
    assert compute_dtype("auto", device) == torch.bfloat16
    with precision(compute_dtype("auto", device), device):
        assert torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16
    assert torch.backends.cuda.matmul.allow_tf32
    bb = load_backbone(assets["gpt_modern"], device)
    bb.set_trainable(1)
    hold_frozen_in(bb, torch.bfloat16)
    assert bb.model.transformer.wte.weight.dtype == torch.bfloat16
    trainable = [p for p in bb.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    opt = make_adamw(trainable, 1e-3, 0.0, device)
    assert opt.defaults["fused"]
    with precision(torch.bfloat16, device):
        loss = bb(torch.randint(0, 500, (2, 16), device=device)).float().logsumexp(-1).mean()
    loss.backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in trainable)


def test_compiled_engine_replays_cuda_graphs_at_a_real_vocabulary(monkeypatch):
    """--compile 1's engine on a GPU at nanochat's vocabulary (65536, where inductor's scan in the old sampler
    crashed): after warm-up every decode step is a CUDA graph replay (the profiler's cudaGraphLaunch, one per
    step) and none was skipped (torch's cudagraph_skips counter; the KV cache and step buffers are static
    addresses); greedy fp32 tokens equal eager's; sampling with top-k and top-p under bf16 (a bf16 copy of the
    weights) compiles and runs too."""
    import sys

    from conftest import REPO
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    from nanochat_ext.engine.engine import Engine
    from nanochat_ext.engine.sampling import SamplingConfig

    sys.path.insert(0, str(REPO / "bench"))
    import bench_gpu

    device = torch.device("cuda")
    counters.clear()  # what earlier tests in this process counted is not this test's
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # fp32: they differ by rounding alone
    bb = bench_gpu.make_backbone(bench_gpu.shape_config("d2:65536"), device, 0)
    prompts = [list(range(5, 29)), list(range(7, 12))]
    gens = lambda: [torch.Generator().manual_seed(i) for i in range(2)]  # noqa: E731
    greedy = SamplingConfig(16, 0.0)
    eager = Engine(bb).generate(prompts, 2, greedy, -1, 0, gens())
    engine = Engine(bb, compile=True)
    runs = [engine.generate(prompts, 2, greedy, -1, 0, gens()) for _ in range(3)]  # warm-up, record, replay
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runs.append(engine.generate(prompts, 2, greedy, -1, 0, gens()))
    launches = sum(e.count for e in prof.key_averages() if e.key == "cudaGraphLaunch")
    assert launches >= greedy.max_new_tokens - 1 and counters["inductor"]["cudagraph_skips"] == 0, launches
    assert all(run == eager for run in runs)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        sampled = engine.generate(prompts, 2, SamplingConfig(16, 1.0, top_k=50, top_p=0.9), -1, 0, gens())
    assert all(len(c) == 16 for c in sampled.completions) and counters["inductor"]["cudagraph_skips"] == 0


def test_reward_head_inits_on_the_gpu_as_on_cpu(assets):
    """A seed gives the same RM head on CUDA as on CPU (drawing into the CUDA tensor with the CPU generator
    crashed bench_gpu.py's RM bench)."""
    from nanochat_ext.models.loader import load_backbone
    from nanochat_ext.models.reward_model import RewardModel

    heads = []
    for device in ("cpu", "cuda"):
        model = RewardModel(load_backbone(assets["gpt_modern"], device)).to(device)
        model.init_head(3)
        heads.append(model.head.weight.detach().cpu())
    assert torch.equal(*heads)


def test_compiled_blocks_train_at_a_real_vocabulary():
    """--compile 1's blocks on a GPU at nanochat's real vocabulary (65536; the tiny test vocabulary hid a
    compile crash once): bench_gpu's RM full fine-tune and GRPO steps (ragged: their first warm-up step is
    shorter) on a 2-layer model of today's vintage, eager and then compiled under bf16 autocast, with graphs
    compiled and none broken."""
    import sys

    from conftest import REPO
    from torch._dynamo.utils import counters

    sys.path.insert(0, str(REPO / "bench"))
    import bench_gpu

    device = torch.device("cuda")
    counters.clear()  # graph breaks earlier tests in this process added are not this test's

    b = bench_gpu.options("--steps 1 --warmup 2 --rm_pairs 4 --rm_len 256 --grpo_prompts 2 --group_size 4 "
                          "--prompt_len 32 --new_tokens 16 --micro 8".split())
    shape = "d2:65536"
    runs = {}
    for flag in ("0", "1"):
        b.compile = flag
        runs[flag] = bench_gpu.bench_rm(shape, "all", b, device), bench_gpu.bench_grpo(shape, b, device)
    assert runs["1"][0]["compile"].startswith("compile: blocks compiled") and runs["1"][0]["compiled_graphs"] > 0
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_grpo_lora_on_the_gpu_starts_at_its_reference_and_merges(assets, tmp_path):
    """GRPO with LoRA on CUDA (bf16 autocast, the frozen base's matmul weights in bf16, compiled blocks, the engine's
    bf16 copy of the adapters): the reference is the base with the adapters off, so step 1's KL is 0 but for the bf16
    rounding of a training graph and an inference graph that inductor fuses differently (the CPU twin:
    test_lora.test_grpo_lora_in_bf16_compiled_starts_at_its_reference_and_merges); the merged final checkpoint loads
    as a model."""
    from test_lora import starts_at_its_reference_and_merges_onto_the_source

    from nanochat_ext.models.loader import load_backbone

    starts_at_its_reference_and_merges_onto_the_source(assets["gpt_modern"], assets["pairs"], tmp_path / "lora",
                                                       "--device", "cuda")
    load_backbone(tmp_path / "lora")


def test_compiled_step_one_starts_at_its_reference_and_old_policy_on_the_gpu():
    """#42 item 7 on CUDA, bf16 autocast: as test_compiled's CPU test, inductor's training graph against the
    reference's inference graph and pi_old (the first update's own log-probs): nothing clipped at step 1, pi_old
    what the training graph gives again, the KL to an identical reference rounding only."""
    from test_compiled import step_one_against_reference_and_old_policy

    gap, kl, clipped = step_one_against_reference_and_old_policy(torch.device("cuda"), torch.bfloat16)
    assert clipped == 0 and gap < 1e-6 and kl < 1e-3, (gap, kl)
