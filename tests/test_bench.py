"""The benchmarks keep running: the GPU bench at a tiny shape on CPU, and the memory estimator's
byte counting."""
from __future__ import annotations

import json
import subprocess
import sys

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))


def test_gpu_bench_runs_at_a_tiny_shape_on_cpu():
    cmd = [sys.executable, "bench/bench_gpu.py", "--shapes", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "0",
           "--grpo_prompts", "2", "--group_size", "4", "--new_tokens", "8", "--prompt_len", "8", "--rm_pairs", "4",
           "--rm_len", "32", "--micro", "4"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["bench"] for r in rows] == ["gpu_rm"] * 3 + ["gpu_grpo"]
    assert [r["unfreeze_last"] for r in rows[:3]] == ["0", "2", "all"]
    assert rows[0]["trainable"] < rows[1]["trainable"] < rows[2]["trainable"]
    assert all(r["tflops"] > 0 for r in rows[:3])
    grpo = rows[3]
    assert grpo["gen_tokens_per_s"] > 0 and grpo["train_tokens_per_s"] > 0
    assert abs(grpo["s_per_step"] - sum(grpo[f"s_{k}"] for k in ("generation", "scoring", "reference", "training"))) < 0.01


def test_block_flops_follow_the_written_formula():
    from bench_gpu import block_fwd_flops, shape_config
    from nanochat_ext.gpt import GPT

    cfg = shape_config("d20", "dec2025")
    with FakeTensorMode():
        model = GPT(cfg)
    d = cfg.n_embd
    # A dec2025 block: q, k, v, proj (d x d each) and a 4x MLP: 12 d^2 matmul weights; full attention.
    assert block_fwd_flops(cfg, list(model.transformer.h), 512) == 20 * (2 * 12 * d * d + 4 * d * 512)


def test_live_bytes_counts_storages_once_and_frees_them():
    from memory_estimate import LiveBytes

    with FakeTensorMode(), LiveBytes() as mem:
        x = torch.empty(1024, 256)  # 1 MiB
        view = x[:10]  # a view: no new storage
        assert mem.live == 2**20
        y = (x + 1).to(torch.bfloat16)  # the fp32 temporary is freed, its bf16 copy lives
        assert mem.live == 2**20 + 2**19 and mem.peak == 2 * 2**20 + 2**19
        del y, view
        assert mem.live == 2**20


def test_profile_summary_names_the_top_ops_of_both_trainers(assets):
    cmd = [sys.executable, "bench/profile_steps.py", "--backbone", str(assets["hf"]), "--pairs", str(assets["pairs"]),
           "--prompts", str(assets["pairs"]), "--threads", "1", "--steps", "2", "--top", "3"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["trainer"] for r in rows] == ["rm_full_finetune", "grpo"]
    for r in rows:
        assert len(r["top"]) == 3 and r["total_ms"] > 0 and r["top"][0]["self_ms"] >= r["top"][1]["self_ms"]


def test_prefix_tree_bench_runs_and_says_which_layout_ran(assets):
    cmd = [sys.executable, "bench/bench_prefix_tree.py", "--backbone", str(assets["gpt_modern"]), "--threads", "1",
           "--shapes", "35+8x32", "--repeats", "1", "--steps", "1"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    row = json.loads(proc.stdout.splitlines()[-1])
    assert row["shape"] == "35+8x32" and row["tree"] is True and row["ms_per_group"] > 0
