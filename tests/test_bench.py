"""The benchmarks keep running: the one GPU command at a tiny shape on CPU, its table, nanochat's shapes,
and the memory estimator's byte counting."""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO
from torch._subclasses.fake_tensor import FakeTensorMode

sys.path.insert(0, str(REPO / "bench"))


def test_the_gpu_command_runs_at_a_tiny_shape_on_cpu(assets, tmp_path):
    """bash bench/run_gpu.sh, as a GPU machine runs it (python3 as found, no venv), on CPU at a tiny shape:
    the CUDA tests' summary, our RM and GRPO benches as JSON lines in one file, and the table; the real model's row
    from a shape carried without weights (a tiny Hugging Face Llama's here). The LM head's chain eager only: its
    inductor compile (16 s of this test's 46 on 2 cores) is test_grpo's
    test_compiled_lm_head_chain_equals_eager_in_chunks_and_whole."""
    from model_shape import strip

    results, shape = tmp_path / "gpu.jsonl", tmp_path / "shape"
    strip(assets["hf"], shape)
    assert (shape / "config.json").is_file() and not list(shape.glob("*.safetensors"))
    small = ("--steps 1 --warmup 0 --grpo_prompts 2 --group_size 4 --new_tokens 8 --prompt_len 8 --rm_pairs 4 "
             "--rm_len 32 --micro 4 --dpo_pairs 2 --dpo_len 8 --dpo_micro 1")
    env = {"OMP_NUM_THREADS": "1", "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "DEVICE": "cpu",
           "SHAPES": "tiny", "FSDP_SHAPES": "tiny", "LORA_SHAPES": "", "BENCH_ARGS": small, "RESULTS": str(results),
           "WHEELS": str(tmp_path / "none"),
           "LM_HEAD_ARGS": "--rows 64 --vocab 512 --hidden 32 --repeats 1 --compiled eager",
           "NANOCHAT_SRC": str(tmp_path / "none"),  # no nanochat beside ours (a checkout may carry .nanochat)
           "CUDA_VISIBLE_DEVICES": "",  # the CUDA tests skip here even on a GPU machine (they run in -m cuda)
           "REAL_SHAPE": str(shape), "REAL_ARGS": "--steps 2 --warmup 1 --new_tokens 4"}
    proc = subprocess.run(["bash", "bench/run_gpu.sh"], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["bench"] for r in rows] == ["cuda_tests"] + ["lm_head_chain"] * 2 + ["gpu_rm"] * 3 + \
        ["gpu_grpo", "gpu_dpo", "gpu_decode", "gpu_decode", "gpu_optimizer", "gpu_optimizer"] + \
        ["gpu_rm", "gpu_grpo"] * 2 + ["nanochat_ext_grpo"]  # then FSDP on one rank, without and
    # with AC (LoRA's rows: the next test)
    head, rows = rows[1:3], rows[:1] + rows[3:]
    assert [(r["compiled"], r["mode"]) for r in head] == [("eager", "forward"), ("eager", "forward_backward")]
    assert all(r["ms"] > 0 for r in head)
    optim, fsdp = rows[8:10], rows[10:14]
    assert [r["optimizer"] for r in optim] == ["adamw", "muon"] and all(r["ms_per_step"] > 0 for r in optim)
    assert [(r["parallel"], r["activation_checkpointing"])
            for r in fsdp] == [("fsdp", False)] * 2 + [("fsdp", True)] * 2
    assert all(r["unfreeze_last"] == "all" and r["pairs_per_s"] > 0 for r in fsdp[::2])
    assert all(r["train_tokens_per_s"] > 0 and r["decode_tok_per_s"] > 0 for r in fsdp[1::2])
    assert "skipped" in rows[0]["summary"] and "failed" not in rows[0]["summary"]  # no GPU here
    tests_log = (tmp_path / "gpu_cuda_tests.log").read_text()  # streamed a line per test: a cut call keeps it
    assert "test_cuda.py::test_pipeline_on_one_gpu_with_nccl SKIPPED" in tests_log
    rm, grpo, dpo, decode, tools = rows[1:4], rows[4], rows[5], rows[6], rows[7]
    assert [r["unfreeze_last"] for r in rm] == ["0", "2", "all"]
    assert rm[0]["trainable"] < rm[1]["trainable"] < rm[2]["trainable"]
    assert all(r["tflops"] > 0 for r in rm)
    assert grpo["gen_tokens_per_s"] > 0 and grpo["train_tokens_per_s"] > 0 and grpo["decode_tok_per_s"] > 0
    assert abs(grpo["engine_ratio"] - 1) < 0.05 and grpo["engine_far"] == 0  # the mismatch a GPU's row will show
    assert decode["engine"] == "ours eager" and decode["rows"] == 8 and decode["decode_tok_per_s"] > 0  # CPU: eager
    assert tools["engine"] == "ours eager +tools" and tools["decode_tok_per_s"] > 0
    assert dpo["pairs_per_step"] == 2 and dpo["pairs_per_s"] > 0 and dpo["tflops"] > 0
    assert f"| {dpo['pairs_per_s']} (-) / - |" in proc.stdout
    assert abs(grpo["s_per_step"] - sum(grpo[f"s_{k}"]
                                        for k in ("generation", "scoring", "reference", "training"))) < 0.01
    assert f"| tiny | {rm[0]['pairs_per_s']} (-) |" in proc.stdout and "trl does not import here" in proc.stderr
    assert "| tiny fsdp | - | - | " in proc.stdout and "| tiny fsdp +AC | - | - | " in proc.stdout
    assert f"| {optim[0]['ms_per_step']} / {optim[1]['ms_per_step']} |" in proc.stdout
    assert f"| GRPO | {rows[-1]['completions_per_s']} | - | - |" in proc.stdout and rows[-1]["completions_per_s"] > 0


def test_every_pinned_requirement_reaches_the_gpu_machine():
    """Each pin of requirements.txt is carried as a wheel by bench/fetch_gpu_wheels.sh at the pinned version, or named
    there as in the GPU image or not needed: a new pin left out stopped the CUDA tests at collection
    (gguf)."""
    script = (REPO / "bench" / "fetch_gpu_wheels.sh").read_text()
    fetched = dict(re.findall(r"([A-Za-z0-9_.-]+)==([0-9][^\s]*)", script.split("pip download", 1)[1]))
    named = set()
    for variable in ("IMAGE_HAS", "NOT_CARRIED"):
        named |= set(re.search(rf'^{variable}="([^"]*)"', script, re.M).group(1).split())
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (REPO / "requirements.txt").read_text(), re.M))
    assert pins and "gguf" in pins
    for name, version in pins.items():
        assert fetched.get(name, version) == version, f"{name}: fetched at {fetched[name]}, pinned at {version}"
        assert name in fetched or name in named, f"requirements.txt pins {name}: fetch_gpu_wheels.sh neither " \
            "fetches it nor names it in IMAGE_HAS or NOT_CARRIED"


def test_the_gpu_bench_runs_grpo_with_lora_as_the_trainer_does():
    """bench_gpu.py --lora_r (run_gpu.sh's LORA_SHAPES rows), in this process at a tiny shape: only the adapters
    train, and the table gives the row its own label."""
    from bench_gpu import bench_grpo, options
    from gpu_table import label

    small = "--group_size 4 --grpo_prompts 2 --prompt_len 8 --new_tokens 8 --micro 4 --compile 0 --warmup 0 --steps 1"
    full, lora = (bench_grpo("tiny", options([*small.split(), "--lora_r", str(r)]), torch.device("cpu"))
                  for r in (0, 16))
    assert lora["lora_r"] == 16 and 0 < lora["params"] < full["params"] and lora["train_tokens_per_s"] > 0
    assert label(lora) == "tiny LoRA r16" and label(full) == "tiny"


def test_the_gpu_bench_steps_both_optimizers():
    """bench_gpu.py's optimizer rows (run_gpu.sh measures them at every shape): AdamW and nanochat's MuonAdamW each
    take timed steps over the whole policy and keep state."""
    from bench_gpu import bench_optimizer, options

    rows = bench_optimizer("tiny", options(["--warmup", "1", "--steps", "1"]), torch.device("cpu"))
    assert [r["optimizer"] for r in rows] == ["adamw", "muon"]
    assert all(r["ms_per_step"] > 0 and r["state_gb"] > 0 and r["params"] == rows[0]["params"] for r in rows)


def test_gpu_table_puts_ours_beside_trl():
    from gpu_table import table

    rm = [{"bench": "gpu_rm", "shape": "d20", "unfreeze_last": u, "pairs_per_s": 10.0, "mfu": 0.25, "peak_mem_gb": 50.0}
          for u in ("0", "2", "all")]
    ours = {"bench": "gpu_grpo", "shape": "d20", "completions_per_s": 30.0, "s_generation": 1.0, "s_scoring": 0.1,
            "s_reference": 0.2, "s_training": 0.5, "train_mfu": 0.4, "peak_mem_gb": {"training": 45.5}}
    trl = {"bench": "trl_gpu_grpo", "shape": "d20", "completions_per_s": 20.0}
    decode = [{"bench": "gpu_decode", "shape": "d20", "engine": "ours eager", "decode_tok_per_s": 9800.0,
               "decode_mbu": 0.1}, {"bench": "gpu_decode", "shape": "d20", "engine": "nanochat",
                                    "decode_tok_per_s": 10300.0, "decode_mbu": None}]
    optim = [{"bench": "gpu_optimizer", "shape": "d20", "optimizer": k, "ms_per_step": ms}
             for k, ms in (("adamw", 12.5), ("muon", 40.0))]
    dpo = [{"bench": "gpu_dpo", "shape": "d20", "pairs_per_s": 12.0, "mfu": 0.3},
           {"bench": "trl_gpu_dpo", "shape": "d20", "pairs_per_s": 8.0}]
    out = table([{"bench": "cuda_tests", "summary": "5 passed in 9s"}, *rm, ours, trl, *dpo, *decode, *optim])
    assert out.splitlines()[0] == "CUDA tests: 5 passed in 9s"
    assert out.splitlines()[-1] == ("| d20 | 10.0 (25.0%) | 10.0 (25.0%) | 10.0 (25.0%, 50.0) | 30.0 / 20.0 (1.50x) | "
                                    "1.0 / 0.1 / 0.2 / 0.5 | 40.0%; 45.5 | 12.0 (30.0%) / 8.0 (1.50x) | "
                                    "9800.0 (10.0%) / - / - / - / 10300.0 | "
                                    "12.5 / 40.0 |")


def test_real_model_table_reads_the_last_sitting(tmp_path):
    """bench/real_model_table.py on bench_real_model.sh's rows: medians of completions/s and their ratio, the first
    evaluation at or above each threshold, accuracy at the steps both evaluated; an earlier sitting is left out."""
    from real_model_table import main

    def curve(bench, points):
        return [{"bench": bench, "step": s, "train_s": t, "greedy_accuracy": a, "sitting": "b"} for s, t, a in points]

    rows = [{"bench": "nanochat_ext_grpo", "completions_per_s": 99.0, "sitting": "a"},
            *({"bench": "nanochat_ext_grpo", "completions_per_s": c, "sitting": "b"} for c in (4.0, 2.0, 3.0)),
            *({"bench": "trl_real_model_throughput", "completions_per_s": c, "sitting": "b"} for c in (1.0, 2.0, 1.5)),
            *curve("ours_time_to_accuracy", [(0, 0.0, 0.1), (10, 40.0, 0.35), (20, 80.0, 0.5)]),
            *curve("trl_time_to_accuracy", [(0, 0.0, 0.1), (10, 100.0, 0.2), (20, 200.0, 0.42), (25, 250.0, 0.45)]),
            # the RM alone in a later sitting (PARTS=rm): its own table, the GRPO one still from sitting b
            *({"bench": "nanochat_ext_rm", "pairs_per_s": p, "sitting": "c"} for p in (6.0, 5.0)),
            {"bench": "trl_real_rm", "pairs_per_s": 2.0, "sitting": "c"}]
    results = tmp_path / "real_model.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run([sys.executable, str(REPO / "bench" / "real_model_table.py"), str(results)],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert "| median | 3.00 (n=3) | 1.50 (n=3) | 2.00x |" in out
    assert out[out.index("| accuracy reached | ours | TRL |") + 2:][:3] == [
        "| >= 0.3 | 40.0 s (step 10) | 200.0 s (step 20) |", "| >= 0.4 | 80.0 s (step 20) | 200.0 s (step 20) |",
        "| >= 0.5 | 80.0 s (step 20) | - |"]
    at = out.index("| step | ours accuracy | TRL accuracy | ours train s | TRL train s |")
    assert out[at + 2:at + 5] == ["| 0 | 0.100 | 0.100 | 0.0 | 0.0 |", "| 10 | 0.350 | 0.200 | 40.0 | 100.0 |",
                                  "| 20 | 0.500 | 0.420 | 80.0 | 200.0 |"]
    assert out[-1] == "| median | 5.50 (n=2) | 2.00 (n=1) | 2.75x |"
    results.write_text("{\n")
    assert main([str(results)]) == 2


def test_methods_table_averages_seeds_and_pairs_them_with_grpo(tmp_path):
    """bench/methods_table.py on methods_real_model.sh's rows: each method's accuracy at each step over its seeds
    (mean, lowest-highest), its last step's sampled accuracy and seconds (training, and the whole call), its last
    accuracy minus GRPO's seed by seed; a run cut short (no summary line) is left out, and a rerun's line replaces
    the earlier one."""
    from methods_table import main

    def run(label, seed, points, summary=True):
        rows = [{"bench": "ours_time_to_accuracy", "label": label, "seed": seed, "step": s, "train_s": t,
                 "greedy_accuracy": a, "sampled_accuracy": a / 2} for s, t, a in points]
        return rows + ([{"bench": "ours_time_to_accuracy_summary", "label": label, "seed": seed,
                         "train_call_s": 60.0 + seed}] if summary else [])

    rows = [*run("grpo", 0, [(0, 0.0, 0.1), (10, 40.0, 0.5)]), *run("grpo", 1, [(0, 0.0, 0.2), (10, 50.0, 0.3)]),
            *run("rloo", 0, [(0, 0.0, 0.1), (10, 40.0, 0.9)]),  # replaced below by the same run's later line
            *run("rloo", 0, [(10, 44.0, 0.6)]), *run("rloo", 1, [(0, 0.0, 0.2), (10, 42.0, 0.2)]),
            *run("rloo", 2, [(0, 0.0, 0.9), (10, 9.0, 0.9)], summary=False)]
    results = tmp_path / "methods.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run([sys.executable, str(REPO / "bench" / "methods_table.py"), str(results)],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[4:6] == ["| grpo | 0 1 | 0.150 (0.100-0.200) | 0.400 (0.300-0.500) | 0.200 (0.150-0.250) | "
                        "45.0 | 60.5 |",
                        "| rloo | 0 1 | 0.150 (0.100-0.200) | 0.400 (0.200-0.600) | 0.200 (0.100-0.300) | "
                        "43.0 | 60.5 |"]
    assert out[-1] == "| rloo | +0.100 (seed 0), -0.100 (seed 1) | +0.000 |"
    results.write_text("{\n")
    assert main([str(results)]) == 2


def test_the_lr_sweep_reads_each_runs_metrics_and_its_evaluation(tmp_path):
    """bench/lr_sweep_row.py, one JSON line per rate of bench/lr_sweep.sh: GRPO's evaluations (best, last), the RM's
    held-out accuracy, DPO's last margin beside kat_eval's accuracy of that rate's policy and of the model before; an
    unknown method is the sweep's usage line."""
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    rows = [{"step": 0, "eval/reward_greedy": 0.1}, {"step": 1, "train/reward": 0.2, "train/loss": 0.7,
            "train/grad_norm": 3.0, "train/entropy": 2.0, "rewards/margins": 0.1, "rewards/accuracies": 0.5,
            "logps/chosen": -20.0},
            {"step": 2, "train/reward": 0.6, "train/loss": 0.4, "train/grad_norm": 9.0, "train/entropy": 1.0,
             "rewards/margins": 0.8, "rewards/accuracies": 1.0, "logps/chosen": -30.0, "eval/reward_greedy": 0.5,
             "val/accuracy": 0.7, "val/loss": 0.6},
            {"step": 2, "eval/reward_greedy": 0.3}]
    (run / "logs" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"policies": {"before": {"task_accuracy_greedy": 0.1, "tool_use": {}},
                                               "lr 1e-05": {"task_accuracy_greedy": 0.4, "tool_use": {}}}}))

    def row(*args):
        return json.loads(subprocess.run([sys.executable, str(REPO / "bench" / "lr_sweep_row.py"), *args],
                                         capture_output=True, text=True, check=True).stdout)

    grpo = row("grpo", str(run), "3e-5")
    assert (grpo["lr"], grpo["steps"], grpo["best"], grpo["last"]) == (3e-5, 2, 0.5, 0.3)
    assert grpo["eval_greedy"] == [[0, 0.1], [2, 0.5], [2, 0.3]] and grpo["grad_norm_max"] == 9.0
    assert (grpo["entropy_first"], grpo["entropy_last5"]) == (2.0, 1.5)
    rm = row("rm", str(run), "1e-4", "2", "30", "8")
    assert (rm["unfreeze_last"], rm["val_accuracy"],
            rm["train_loss_first"], rm["train_loss_last"]) == ("2", 0.7, 0.7, 0.4)
    dpo = row("dpo", str(run), "1e-05", str(report))
    assert (dpo["task_accuracy_greedy"], dpo["before_task_accuracy_greedy"]) == (0.4, 0.1)
    assert (dpo["margin_last"], dpo["pair_accuracy_last"], dpo["train_loss_last"]) == (0.8, 1.0, 0.4)
    assert dpo["logps_chosen_last"] == -30.0
    usage = subprocess.run(["bash", str(REPO / "bench" / "lr_sweep.sh"), "ppo"], capture_output=True, text=True)
    assert usage.returncode == 2 and "lr_sweep.sh rm|grpo|dpo|sft" in usage.stderr


def test_our_curve_pairs_each_evaluation_with_its_steps_seconds():
    """bench/ours_real_model.py reads kat_train_grpo's metrics.jsonl: each evaluation's greedy accuracy beside the
    training seconds and lr logged at the same step, the final evaluation once."""
    from ours_real_model import curve

    logs = [{"step": 1, "perf/train_time_s": 5.0, "train/lr": 3e-5},
            {"step": 2, "perf/train_time_s": 9.5, "train/lr": 2e-5},
            {"step": 2, "eval/last_number_greedy": 0.25, "eval/last_number_sampled": 0.125},
            {"step": 3, "perf/train_time_s": 14.0, "train/lr": 1e-5},
            {"step": 3, "eval/last_number_greedy": 0.5, "eval/last_number_sampled": 0.25},
            {"step": 3, "eval/last_number_greedy": 0.5, "eval/last_number_sampled": 0.25}]
    assert [(r["step"], r["train_s"], r["greedy_accuracy"], r["sampled_accuracy"], r["lr"]) for r in curve(logs)] == \
        [(2, 9.5, 0.25, 0.125, 2e-5), (3, 14.0, 0.5, 0.25, 1e-5)]


def test_the_peak_rate_is_known_for_the_gpus_we_are_lent(monkeypatch):
    """MFU's denominator on an H100 or H200 (the split of bench_gpu.py once lost the table: every CUDA row failed while
    the CPU smoke test, which has no peak, passed)."""
    from gpu_measure import peak_tflops

    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert peak_tflops(torch.device("cuda"), None) == 989.4
    assert peak_tflops(torch.device("cpu"), None) is None and peak_tflops(torch.device("cpu"), 100.0) == 100.0


def test_shapes_follow_nanochats_rule():
    """nanochat's base_train.py: model_dim = depth x 64 rounded up to a multiple of head_dim 128."""
    from bench_gpu import nanochat_dims, shape_config

    assert nanochat_dims("d20") == (20, 1280, 10, 65536)
    assert nanochat_dims("d24:32768") == (24, 1536, 12, 32768)  # the speedrun's model and tokenizer
    assert nanochat_dims("d13") == (13, 896, 7, 65536)  # 832 rounded up
    cfg = shape_config("d24:32768")
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size) == (24, 1536, 12, 32768)


def test_block_flops_follow_the_written_formula():
    from bench_gpu import block_fwd_flops, shape_config

    from nanochat_ext.models.gpt import GPT

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


def test_profile_summary_names_the_top_ops_of_both_trainers(assets, tmp_path):
    prompts = tmp_path / "prompts.jsonl"  # with the answers its exact_match reward reads
    prompts.write_text("".join(json.dumps({"prompt": f"What is {a} plus 2?", "answer": str(a + 2)}) + "\n"
                               for a in range(8)))
    cmd = [sys.executable, "bench/profile_steps.py", "--backbone", str(assets["hf"]), "--pairs", str(assets["pairs"]),
           "--prompts", str(prompts), "--threads", "1", "--steps", "2", "--top", "3"]
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


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_memory_arithmetic_holds_against_fake_tensors(checkpointing, device):
    """nanochat_ext.training.memory's training phase of a GRPO step (nanochat d12 at its 32768 vocabulary, 256
    completions of 128 + 512 tokens, micro-batches of 16) against the same step run on fake tensors through our own
    modules, whose live bytes torch's dispatcher reports: within 10%, with and without activation checkpointing, by
    CPU's autocast rules and by CUDA's (pow and rms_norm in fp32: 13.2 GiB against CPU's 11.8 without checkpointing,
    which the CPU-calibrated arithmetic put at 11.65)."""
    import memory_estimate
    from bench_gpu import shape_config

    b = argparse.Namespace(prompts=16, group_size=16, prompt_len=128, new_tokens=512, micro=16)
    fake = memory_estimate.grpo_step(shape_config("d12:32768"), True, 16, 16, 128, 512, 16, checkpointing,
                                     device)["training"]
    modelled = memory_estimate.modelled_training("d12:32768", checkpointing, b, device) / 2**30
    assert modelled == pytest.approx(fake, rel=0.1)


LAYOUT_OPS = ("__getitem__", "contiguous", "float", "reshape", "to", "transpose", "unsqueeze", "view")  # no arithmetic


def _autocast_calls():
    """A call of every op whose autocast dtype is checked, by the function torch's dispatch sees; each takes a tensor
    maker (shape, dtype) for the device under test."""
    import torch.nn.functional as F

    def x(make, dtype):
        return make((4, 8), dtype)

    def pair(f):
        return lambda make, dtype: f(x(make, dtype), make((4, 8), torch.float32))

    one = {f: (lambda make, dtype, f=f: f(x(make, dtype))) for f in (
        torch.square, torch.Tensor.square, torch.Tensor.neg, torch.sigmoid, torch.tanh, F.relu, F.silu)}
    return {**one,
            torch.pow: lambda make, dtype: torch.pow(x(make, dtype), 2),
            torch.Tensor.pow: lambda make, dtype: x(make, dtype).pow(2),
            torch.rms_norm: lambda make, dtype: torch.rms_norm(x(make, dtype), (8,)),
            F.rms_norm: lambda make, dtype: F.rms_norm(x(make, dtype), (8,)),
            **{f: (lambda make, dtype, f=f: f(x(make, dtype), -1)) for f in (
                torch.softmax, F.softmax, torch.Tensor.softmax, torch.log_softmax, F.log_softmax,
                torch.Tensor.log_softmax)},
            **{f: pair(f) for f in (torch.Tensor.add, torch.Tensor.sub, torch.Tensor.mul, torch.Tensor.div)},
            F.linear: lambda make, dtype: F.linear(x(make, dtype), make((8, 8), torch.float32)),
            torch.cat: lambda make, dtype: torch.cat([x(make, dtype), make((4, 8), torch.float32)], 1),
            F.embedding: lambda make, dtype: F.embedding(make((3,), torch.long), make((8, 8), dtype)),
            F.scaled_dot_product_attention: lambda make, dtype: F.scaled_dot_product_attention(
                *(make((1, 2, 4, 8), dtype) for _ in range(3)), is_causal=True)}


def test_cuda_autocast_rules_are_torchs_own(assets):
    """memory_estimate.CudaAutocastRules against torch's own CUDA autocast, which the dispatcher applies to fake CUDA
    tensors (no GPU needed): every op our models run under autocast (recorded from a nanochat GPT's and the native
    Llama's forward and LM head) and every op in CUDA_FP32_OPS gives CUDA's dtype, for bf16 inputs and fp32, and the
    listed ones are those where CPU's autocast gives another."""
    from memory_estimate import CUDA_FP32_OPS, CudaAutocastRules
    from torch.overrides import TorchFunctionMode

    from nanochat_ext.models.loader import load_backbone

    class Record(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.is_floating_point() and func.__name__ not in LAYOUT_OPS:
                self.ops.add(func)
            return out

    record = Record()
    for path in (assets["gpt_modern"], assets["hf"]):
        bb = load_backbone(path)
        with torch.autocast("cpu", dtype=torch.bfloat16), record:
            bb.logits(bb.hidden_states(torch.randint(0, 100, (2, 9))))
    calls = _autocast_calls()
    assert record.ops and not record.ops - set(calls), record.ops - set(calls)  # every op our models run is checked
    assert set(CUDA_FP32_OPS) <= set(calls)

    def on_cuda(call, dtype):
        state = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
        torch.set_autocast_enabled("cuda", True)  # what torch.autocast("cuda") sets, where a GPU is
        torch.set_autocast_dtype("cuda", torch.bfloat16)
        try:
            return call(lambda shape, dt: torch.empty(shape, dtype=dt, device="cuda"), dtype).dtype
        finally:
            torch.set_autocast_enabled("cuda", state[0])
            torch.set_autocast_dtype("cuda", state[1])

    with FakeTensorMode():
        for op, call in calls.items():
            for dtype in (torch.bfloat16, torch.float32):
                def make(shape, dt):
                    return torch.empty(shape, dtype=dt)

                with torch.autocast("cpu", dtype=torch.bfloat16):
                    cpu = call(make, dtype).dtype
                    with CudaAutocastRules():
                        emulated = call(make, dtype).dtype
                assert emulated == on_cuda(call, dtype), (op, dtype)
                if dtype == torch.bfloat16:  # listed exactly where the devices part
                    assert (op in CUDA_FP32_OPS) == (cpu != emulated), op


def test_the_benchmark_assets_are_made_from_a_clone(tmp_path):
    """bench/make_assets.py (what bench/run_all.sh uses with no ../shared/anchor-bench): the anchor bench's model shape,
    pairs of at most 128 tokens and prompts of at most 64, as its settings assume, the same files for the same seed."""
    import make_assets
    from transformers import AutoConfig, AutoTokenizer

    assert make_assets.main(["--out", str(tmp_path / "a"), "--seed", "7"]) == 0
    c = AutoConfig.from_pretrained(tmp_path / "a" / "tiny-llama")
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size,
            c.vocab_size, c.tie_word_embeddings) == (128, 4, 4, 2, 512, 2048, False)
    tok = AutoTokenizer.from_pretrained(tmp_path / "a" / "tiny-llama")
    pairs = [json.loads(line) for line in (tmp_path / "a" / "pairs.jsonl").read_text().splitlines()]
    prompts = [json.loads(line) for line in (tmp_path / "a" / "prompts.jsonl").read_text().splitlines()]
    assert len(pairs) == 2000 and len(prompts) == 512 and all("answer" in p for p in prompts)
    assert max(len(tok(p["prompt"] + max(p["chosen"], p["rejected"], key=len))["input_ids"]) for p in pairs) < 128
    assert max(len(tok(p["prompt"])["input_ids"]) for p in prompts) <= 64
    make_assets.main(["--out", str(tmp_path / "b"), "--seed", "7"])
    assert (tmp_path / "b" / "pairs.jsonl").read_text() == (tmp_path / "a" / "pairs.jsonl").read_text()


def test_the_decode_tail_bench_compares_both_ways_on_the_same_rows(assets, capsys):
    """bench_decode_tail.py on the tiny Llama (a stand-in for SmolLM2): one line per way, the same rows and steps,
    fewer row-steps where the rows that stopped were dropped (a chat model's stop tokens end its replies)."""
    import bench_decode_tail

    bench_decode_tail.main(["--model", str(assets["hf"]), "--prompts", "2", "--group_size", "4", "--new_tokens", "24",
                            "--threads", "1", "--repeats", "1"])
    kept, dropped, summary = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (kept["drop_finished"], dropped["drop_finished"]) == (False, True)
    assert kept["rows"] == dropped["rows"] == 8 and kept["row_steps"] == 8 * kept["steps"]
    assert dropped["row_steps"] <= kept["row_steps"] and summary["speedup"] > 0


def test_the_ab_table_gives_each_trees_median_and_range_and_their_ratio():
    """bench/ab.sh's table: per bench, each tree's median over its rounds with min-max, and new / old."""
    from ab_table import table

    runs = [{"ab_bench": "grpo", "tree": t, "completions_per_s": v} for t, v in
            [("old", 30.0), ("new", 33.0), ("new", 36.0), ("old", 28.0), ("old", 32.0), ("new", 30.0)]]
    runs += [{"ab_bench": "rm", "tree": t, "pairs_per_s": v} for t, v in [("old", 100.0), ("new", 90.0)]]
    assert table(runs, "abc", "def").splitlines()[2:] == [
        "| grpo (completions_per_s) | 30.00 [28.00-32.00] (n=3) | 33.00 [30.00-36.00] (n=3) | 1.100 |",
        "| rm (pairs_per_s) | 100.00 [100.00-100.00] (n=1) | 90.00 [90.00-90.00] (n=1) | 0.900 |"]


def test_the_demo_check_holds_each_seed_against_the_ranges_the_docs_state():
    """bench/demo_check.py reads its ranges from docs/pipeline.md's demo paragraph (so a figure the docs state is the
    one it checks), takes a report's figures as kat_eval writes them, and names a seed's figure below its range."""
    import demo_check

    ranges = demo_check.documented_ranges(demo_check.DOCS.read_text())
    assert ranges == {"rm_accuracy": (0.93, 0.98), "grpo_sampled": (0.85, 0.89)}
    report = {"reward_models": {"a/uniform": {"overall": {"accuracy": 0.94}},
                                "a/density": {"overall": {"accuracy": 0.92}}},
              "policies": {"before (SFT)": {"task_accuracy_sampled": 0.5},
                           "GRPO uniform": {"task_accuracy_sampled": 0.54, "tool_use": {"accuracy_with_tools": 0.7}}}}
    found = demo_check.figures(report)
    assert found == {"rm_accuracy": 0.92, "sft_sampled": 0.5, "grpo_sampled": 0.54, "grpo_calculator": 0.7}
    assert demo_check.shortfalls(found, ranges, slack=0.02) == ["grpo_sampled 0.540 < 0.850 - 0.02 (docs: 0.85-0.89)"]
    with pytest.raises(SystemExit, match="no longer says"):
        demo_check.documented_ranges("the demo learns")
