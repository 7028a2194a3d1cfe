"""Reward-model trainer behaviour: it learns, resumes exactly, reloads for scoring, and refuses bad input."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from conftest import run_script

from nanochat_ext.algorithms.rm import RM_LRS
from nanochat_ext.data.rows import load_pairs
from nanochat_ext.models.reward_model import load_reward_model
from nanochat_ext.runtime import oom
from nanochat_ext.runtime.checkpoint import find_checkpoint
from nanochat_ext.runtime.progress import Progress
from nanochat_ext.tasks import synthetic
from nanochat_ext.training import memory
from scripts import kat_train_rm


def base_args(assets, out, *extra) -> list[str]:
    return ["--backbone", str(assets["gpt"]), "--tokenizer", str(assets["tokenizer"]),
            "--pairs", str(assets["pairs"]), "--batch_size", "16", "--max_len", "64", "--device", "cpu",
            "--eval_every", "0", "--log_every", "5", "--out", str(out), *extra]


def newest(d):
    return sorted(d.glob("model_*.pt"), key=lambda p: int(p.stem.split("_")[1]))[-1]


def test_learns_a_preference_and_scores_it(assets, tmp_path):
    out = tmp_path / "rm"
    # 3e-3: the tiny random backbone learns at the head's rate (the default for blocks is set for a real model)
    assert kat_train_rm.main(base_args(assets, out, "--max_steps", "40", "--unfreeze_last", "1", "--lr", "3e-3")) == 0
    meta = json.loads(newest(out).with_name(newest(out).name.replace("model_", "meta_")
                                            .replace(".pt", ".json")).read_text())
    assert meta["kind"] == "reward_model" and meta["step"] == 40
    assert meta["metrics"]["val/accuracy"] >= 0.9, meta["metrics"]
    # The saved RM reloads by itself (backbone + tokenizer found from its meta) and scores new pairs.
    scorer = load_reward_model(out)
    fresh = synthetic.make_pairs(40, seed=99)
    good = scorer.score([r["prompt"] for r in fresh], [r["chosen"] for r in fresh])
    bad = scorer.score([r["prompt"] for r in fresh], [r["rejected"] for r in fresh])
    assert np.mean([g > b for g, b in zip(good, bad)]) >= 0.9
    # TensorBoard events and metrics.jsonl on rank 0.
    assert list((out / "logs").glob("events.out.tfevents.*"))
    assert "val/accuracy" in (out / "logs" / "metrics.jsonl").read_text()


def test_the_default_lr_follows_what_trains_and_a_far_higher_one_is_warned_about(assets, tmp_path, capsys):
    """--lr where not given: the head's rate for the head alone and LoRA, lower ones for blocks and for all (RM_LRS,
    from bench/lr_sweep.sh rm); the checkpoint records the rate the run used. A given --lr 10x or more above the rate
    for what trains is one warning line; one below it, none."""
    runs = {"head": (), "lora": ("--lora_r", "4"), "blocks": ("--unfreeze_last", "1"),
            "all": ("--unfreeze_last", "all")}
    for mode, flags in runs.items():
        out = tmp_path / mode
        assert kat_train_rm.main(base_args(assets, out, "--max_steps", "1", *flags)) == 0
        meta = json.loads(newest(out).with_name(newest(out).name.replace("model_", "meta_")[:-3] + ".json").read_text())
        assert meta["args"]["lr"] == RM_LRS["head" if mode == "lora" else mode], mode
    assert RM_LRS["head"] > RM_LRS["blocks"] > RM_LRS["all"]
    capsys.readouterr()
    for lr, warned in ((RM_LRS["blocks"] * 10, True), (RM_LRS["blocks"] * 5, False)):
        assert kat_train_rm.main(base_args(assets, tmp_path / f"given_{lr}", "--max_steps", "1", "--unfreeze_last", "1",
                                           "--lr", str(lr))) == 0
        said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: --lr")]
        assert len(said) == warned and (not warned or "trains the last 1 block at 10x the default" in said[0]), said
    # A run started before the default followed what trains (its checkpoints record 3e-3 for a block), cut after step
    # 1, goes on at 3e-3 when resumed as it was started, without --lr: a default changed since does not change it.
    def meta_of(model):
        return model.with_name(model.name.replace("model_", "meta_").removesuffix(".pt") + ".json")

    old = tmp_path / "old"
    flags = ("--max_steps", "2", "--unfreeze_last", "1")
    assert kat_train_rm.main(base_args(assets, old, *flags, "--save_every", "1")) == 0
    final = newest(old)
    for path in (final, meta_of(final), final.with_name(final.name.replace("model_", "state_"))):
        path.unlink()
    state_path = newest(old).with_name(newest(old).name.replace("model_", "state_"))
    state = torch.load(state_path, weights_only=False)
    state["args"]["lr"] = 3e-3
    torch.save(state, state_path)
    capsys.readouterr()
    assert kat_train_rm.main(base_args(assets, old, *flags, "--resume", "latest")) == 0
    assert json.loads(meta_of(newest(old)).read_text())["args"]["lr"] == 3e-3
    assert "resume: --lr not given: the run goes on at the 0.003 it started with" in capsys.readouterr().out


def test_resume_continues_exactly(assets, tmp_path):
    args = ("--max_steps", "6", "--unfreeze_last", "1", "--lr", "3e-3", "--batch_size", "8")
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    assert kat_train_rm.main(base_args(assets, straight, *args)) == 0
    assert kat_train_rm.main(base_args(assets, crashed, *args, "--save_every", "4")) == 0
    # Pretend the run died after its step-4 checkpoint: drop everything the final save wrote.
    final = newest(crashed)
    stamp = final.stem.split("_")[1]
    for name in (f"model_{stamp}.pt", f"meta_{stamp}.json", f"state_{stamp}.pt"):
        (crashed / name).unlink()
    assert json.loads((crashed / f"meta_{newest(crashed).stem.split('_')[1]}.json").read_text())["step"] == 4
    assert kat_train_rm.main(base_args(assets, crashed, *args, "--resume", "latest")) == 0
    a = torch.load(newest(straight), weights_only=True)
    b = torch.load(newest(crashed), weights_only=True)
    assert a.keys() == b.keys()
    for k in a:
        # Bitwise: the resumed steps are the uninterrupted run's computation (same kernels, shapes, order).
        torch.testing.assert_close(a[k], b[k], atol=0, rtol=0)


def test_resume_refuses_a_different_batch_size(assets, tmp_path, capsys):
    out = tmp_path / "rm"
    assert kat_train_rm.main(base_args(assets, out, "--max_steps", "2", "--batch_size", "8")) == 0
    n_before = len(list(out.glob("model_*.pt")))
    assert kat_train_rm.main(base_args(assets, out, "--max_steps", "4", "--resume", "latest")) == 2
    assert "--batch_size is 16 but the checkpoint was trained with 8" in capsys.readouterr().err
    assert len(list(out.glob("model_*.pt"))) == n_before


def test_hf_backbone_and_modern_nanochat_train(assets, tmp_path):
    for name in ("hf", "gpt_modern"):
        out = tmp_path / name
        args = base_args(assets, out, "--max_steps", "3", "--unfreeze_last", "1")
        args[1] = str(assets[name])
        if name == "hf":
            args[2:4] = []  # the HF dir carries its own tokenizer
        assert kat_train_rm.main(args) == 0, name
        scorer = load_reward_model(out)
        assert scorer.meta["backbone_kind"] == ("hf" if name == "hf" else "nanochat")
        # The reloaded trainable tensors are the ones saved (not a fresh head init).
        saved = torch.load(newest(out), weights_only=True)
        torch.testing.assert_close(scorer.model.head.weight.detach(), saved["head.weight"])
        (score,) = scorer.score(["What is rain?"], ["Sure, gladly."])
        assert np.isfinite(score)


def test_dashed_aliases_and_help():
    proc = run_script("scripts.kat_train_rm", ["--help"])
    assert proc.returncode == 0
    for flag in ("--backbone", "--pairs", "--density", "--weight_mode", "--unfreeze_last", "--resume"):
        assert flag in proc.stdout
    args = kat_train_rm.parse_args(["--backbone", "b", "--pairs", "p", "--max-steps", "7", "--batch-size", "4"])
    assert args.max_steps == 7 and args.batch_size == 4


# ---- bad input: one clear line, exit 2, nothing written --------------------------------------------
def _write(path, text):
    path.write_text(text)
    return path


GOOD = '{"prompt": "Hi?", "chosen": "Sure, gladly.", "rejected": "No."}\n'


@pytest.mark.parametrize("name,content,expected", [
    ("empty", "", "no preference pairs in file"),
    ("not_json", GOOD + "{oops\n",
     ":2: not valid JSON (Expecting property name enclosed in double quotes at column 2)"),
    ("raw_tab", GOOD + '{"prompt": "Hi\tthere", "chosen": "Yes", "rejected": "No"}\n',
     ":2: not valid JSON (Invalid control character at column 15; a tab or newline inside a string is written \\t or"),
    ("no_chosen", GOOD + '{"prompt": "Hi?", "rejected": "No."}\n', ":2: field 'chosen': missing"),
    ("empty_chosen", GOOD + '{"prompt": "Hi?", "chosen": "  ", "rejected": "No."}\n',
     ":2: field 'chosen': missing or empty"),
    ("int_rejected", GOOD + '{"prompt": "Hi?", "chosen": "Yes", "rejected": 3}\n', ":2: field 'rejected'"),
    ("neg_weight", GOOD + '{"prompt": "Hi?", "chosen": "Yes", "rejected": "No", "weight": -1}\n',
     ":2: field 'weight': must be a positive"),
    ("nan_weight", GOOD + '{"prompt": "Hi?", "chosen": "Yes", "rejected": "No", "weight": NaN}\n',
     ":2: field 'weight'"),
    ("str_weight", GOOD + '{"prompt": "Hi?", "chosen": "Yes", "rejected": "No", "weight": "2"}\n',
     ":2: field 'weight'"),
    ("bad_role", GOOD + '{"prompt": [{"role": "bot", "content": "x"}], "chosen": "Yes", "rejected": "No"}\n',
     ":2: field 'prompt'"),
])
def test_bad_pairs_file(assets, tmp_path, capsys, name, content, expected):
    pairs = _write(tmp_path / f"{name}.jsonl", content)
    args = base_args(assets, tmp_path / "out", "--max_steps", "1")
    args[args.index("--pairs") + 1] = str(pairs)
    assert kat_train_rm.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and str(pairs) in err and expected in err, err
    assert not (tmp_path / "out").exists()


def test_missing_pairs_file(assets, tmp_path, capsys):
    args = base_args(assets, tmp_path / "out", "--max_steps", "1")
    args[args.index("--pairs") + 1] = str(tmp_path / "nope.jsonl")
    assert kat_train_rm.main(args) == 2
    assert "nope.jsonl: file not found" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_skip_bad_rows_reports_the_count(assets, tmp_path, capsys):
    good = (assets["pairs"]).read_text()
    pairs = _write(tmp_path / "mixed.jsonl", good + '{"prompt": "Hi?", "rejected": "No."}\n{bad\n')
    args = base_args(assets, tmp_path / "out", "--max_steps", "1", "--skip_bad_rows")
    args[args.index("--pairs") + 1] = str(pairs)
    assert kat_train_rm.main(args) == 0
    assert "skipped 2 bad rows" in capsys.readouterr().out


def test_density_that_does_not_line_up(assets, tmp_path, capsys):
    rows = load_pairs(assets["pairs"])[0]
    prefix_ids = sorted({r.prefix_id for r in rows})
    first_line = next(r.line for r in rows if r.prefix_id == prefix_ids[0])
    # 1) a JSONL that misses one prompt
    partial = synthetic.write_jsonl(tmp_path / "density.jsonl",
                                    [{"prefix_id": p, "weight": 1.0} for p in prefix_ids[1:]])
    args = base_args(assets, tmp_path / "out", "--max_steps", "1", "--density", str(partial))
    assert kat_train_rm.main(args) == 2
    assert f"row on line {first_line} has prefix_id '{prefix_ids[0]}', which has no density weight" \
        in capsys.readouterr().err
    # 2) the fork's prefixes_all.jsonl + density_weights.npy with one weight too few
    fork = tmp_path / "fork"
    synthetic.write_jsonl(fork / "prefixes_all.jsonl", [{"prefix_id": p} for p in prefix_ids])
    np.save(fork / "density_weights.npy", np.ones(len(prefix_ids) - 1))
    args = base_args(assets, tmp_path / "out", "--max_steps", "1", "--density", str(fork))
    assert kat_train_rm.main(args) == 2
    err = capsys.readouterr().err
    assert "density_weights.npy" in err and "they do not line up" in err
    assert not (tmp_path / "out").exists()
    # 3) a non-positive weight
    bad = synthetic.write_jsonl(tmp_path / "zero.jsonl", [{"prefix_id": p, "weight": 0} for p in prefix_ids])
    args = base_args(assets, tmp_path / "out", "--max_steps", "1", "--density", str(bad))
    assert kat_train_rm.main(args) == 2
    assert "zero.jsonl:1: field 'weight'" in capsys.readouterr().err


def test_backbone_that_is_not_a_checkpoint(assets, tmp_path, capsys):
    (tmp_path / "junk").mkdir()
    args = base_args(assets, tmp_path / "out", "--max_steps", "1")
    args[args.index("--backbone") + 1] = str(tmp_path / "junk")
    assert kat_train_rm.main(args) == 2
    err = capsys.readouterr().err
    assert "junk: not a checkpoint" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_tokenizer_that_does_not_fit_the_backbone(assets, tmp_path, capsys):
    args = base_args(assets, tmp_path / "out", "--max_steps", "1")
    args[args.index("--backbone") + 1] = str(assets["gpt_small_vocab"])
    assert kat_train_rm.main(args) == 2
    assert "tokenizer has 512 ids but the backbone's vocab_size is 300" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_output_dir_that_cannot_be_written(assets, tmp_path, capsys):
    blocker = _write(tmp_path / "a_file", "x")
    assert kat_train_rm.main(base_args(assets, blocker / "sub", "--max_steps", "1")) == 2
    assert "a_file/sub: dir cannot be written (Not a directory)" in capsys.readouterr().err


def test_batch_size_that_micro_batches_do_not_divide(assets, tmp_path, capsys):
    assert kat_train_rm.main(base_args(assets, tmp_path / "out", "--max_steps", "1", "--device_batch_size", "5")) == 2
    assert "--device_batch_size 5 does not divide" in capsys.readouterr().err


def test_bf16_run_holds_frozen_weights_in_bf16_and_scores_as_validated(assets, tmp_path):
    """Under bf16 autocast (what --dtype auto means on CUDA) the frozen backbone is held in bf16 and the
    trained block and head keep fp32 masters; the reloaded RM scores in that same precision, so it
    reproduces the validation margin the run logged."""
    out = tmp_path / "rm"
    args = base_args(assets, out, "--max_steps", "20", "--unfreeze_last", "1", "--dtype", "bfloat16",
                     "--val_ratio", "0.1")
    assert kat_train_rm.main(args) == 0
    meta = json.loads(newest(out).with_name(newest(out).name.replace("model_", "meta_")
                                            .replace(".pt", ".json")).read_text())
    assert meta["dtype"] == "bfloat16"
    scorer = load_reward_model(out)
    assert scorer.dtype == torch.bfloat16
    params = dict(scorer.model.named_parameters())
    last = len(scorer.model.backbone.blocks) - 1
    assert params["backbone.model.transformer.wte.weight"].dtype == torch.bfloat16
    assert params["backbone.model.transformer.h.0.attn.c_q.weight"].dtype == torch.bfloat16
    assert params[f"backbone.model.transformer.h.{last}.attn.c_q.weight"].dtype == torch.float32
    assert params["head.weight"].dtype == torch.float32
    # Score the validation pairs as the run did (same batches of 16 pairs: in bf16 the matmul shapes
    # change the rounding), through the reloaded RM and its own precision: the logged numbers come back.
    from nanochat_ext.data.batching import collate_pairs, tokenize_pairs
    from nanochat_ext.data.rows import split_by_prefix
    from nanochat_ext.runtime.precision import precision
    _, val_rows = split_by_prefix(load_pairs(assets["pairs"])[0], 0.1)
    val, _ = tokenize_pairs(val_rows, scorer.tokenizer, 64)
    margins = []
    with torch.no_grad(), precision(scorer.dtype, scorer.device):
        for i in range(0, len(val), 16):
            b = collate_pairs(val[i:i + 16], scorer.tokenizer.pad_id)
            r = scorer.model(b["input_ids"], b["lengths"]).float()
            margins += (r[:len(r) // 2] - r[len(r) // 2:]).double().tolist()
    margins = np.array(margins)
    assert meta["metrics"]["val/accuracy"] == np.mean(margins > 0)
    assert meta["metrics"]["val/margin"] == pytest.approx(margins.mean(), rel=1e-12)


def test_auto_micro_batch_picks_what_fits_and_trains_as_that_size_given_by_hand(assets, tmp_path, capsys, monkeypatch):
    """--device_batch_size auto under a memory limit (simulated on CPU by NANOCHAT_EXT_FREE_BYTES): the largest
    micro-batch whose estimated peak fits, logged with its figures, and the run's weights are those of the same run
    with that size given by hand, bitwise (the same micro-batches, the same arithmetic)."""
    args = ["--backbone", str(assets["gpt"]), "--tokenizer", str(assets["tokenizer"]), "--pairs", str(assets["pairs"]),
            "--batch_size", "8", "--max_steps", "3", "--unfreeze_last", "1", "--max_len", "64", "--device", "cpu",
            "--eval_every", "0", "--seed", "3"]
    monkeypatch.setenv(memory.FREE_BYTES_ENV, str(2**40))
    assert kat_train_rm.main([*args, "--out", str(tmp_path / "roomy"), "--device_batch_size", "auto"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("micro-batch: auto: "))
    assert line.startswith("micro-batch: auto: 8 of 8 per rank (estimated peak GiB by size: 8: ")
    peaks = {int(k): float(v) for k, v in re.findall(r"(\d+): ([0-9.e+-]+)", line.split("by size: ")[1].split(";")[0])}
    assert sorted(peaks) == [1, 2, 4, 8] and peaks[1] < peaks[2] < peaks[4] < peaks[8]
    free = (peaks[2] + peaks[4]) / 2 / (1 - memory.AUTO_MARGIN) * 2**30  # room for 2 pairs a forward, not for 4
    monkeypatch.setenv(memory.FREE_BYTES_ENV, str(int(free)))
    assert kat_train_rm.main([*args, "--out", str(tmp_path / "auto"), "--device_batch_size", "auto"]) == 0
    out = capsys.readouterr().out
    assert "micro-batch: auto: 2 of 8 per rank" in out \
        and "batch: 8 global = 1 ranks x 4 micro-batches x 2 pairs" in out
    monkeypatch.delenv(memory.FREE_BYTES_ENV)
    assert kat_train_rm.main([*args, "--out", str(tmp_path / "by_hand"), "--device_batch_size", "2"]) == 0
    auto, by_hand = (torch.load(find_checkpoint(tmp_path / d)[0], weights_only=True) for d in ("auto", "by_hand"))
    assert auto.keys() == by_hand.keys() and all(torch.equal(auto[k], by_hand[k]) for k in auto)
    # A resumed run keeps the size its checkpoint was trained with, whatever is free now (here: no limit known).
    capsys.readouterr()
    assert kat_train_rm.main([*args, "--out", str(tmp_path / "auto"), "--device_batch_size", "auto", "--resume",
                              "latest", "--resume_extend", "--max_steps", "4"]) == 0
    assert "micro-batch: auto: 2, as picked by the run this one resumes" in capsys.readouterr().out


def test_pick_micro_batch_takes_the_largest_divisor_that_fits():
    def estimate(micro):
        return memory.StepMemory({"weights": 2**30}, {"activations": micro * 2**30})  # 1 GiB held + 1 GiB a row

    assert memory.pick_micro_batch(12, estimate, None)[0] == 12  # no limit known
    assert memory.pick_micro_batch(12, estimate, int(5.5 * 2**30), margin=0)[0] == 4  # 4 fits (5 GiB), 6 does not
    assert memory.pick_micro_batch(12, estimate, int(7.5 * 2**30), margin=0)[0] == 6
    assert memory.pick_micro_batch(12, estimate, int(7.5 * 2**30), margin=0, prefer=4)[0] == 4  # whole groups first
    assert memory.pick_micro_batch(12, estimate, int(4.5 * 2**30), margin=0, prefer=6)[0] == 3  # no group fits
    assert memory.pick_micro_batch(12, estimate, 4 * 2**30, margin=0.25)[0] == 2  # 3 GiB to spend
    size, line = memory.pick_micro_batch(12, estimate, int(1.5 * 2**30), margin=0)
    assert size == 1 and "1 of 12, though none fits by the estimate" in line


def test_out_of_memory_is_told_apart_and_its_line_names_the_phase_and_the_remedies():
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you "
                       "tried to allocate 1073741824 bytes.")
    wrapped = ValueError("while compiling")
    wrapped.__cause__ = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB.")
    assert oom.is_out_of_memory(cpu) and oom.is_out_of_memory(wrapped) and oom.is_out_of_memory(MemoryError())
    assert not oom.is_out_of_memory(RuntimeError("the tokenizer can't allocate memory for a 0-length string"))
    progress = Progress()
    try:
        with progress.doing("a training micro-batch of 8 pairs", ("--device_batch_size 4", "--activation_checkpointing",
                                                                    oom.FEWER_RANKS_STATE)):
            with progress.doing("the LM head", ("--device_batch_size 4",)):  # the innermost phase names it
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has ...")
    except torch.OutOfMemoryError as e:
        line = oom.out_of_memory_line(e, progress.phase_of(e), dict(activation_checkpointing=True, parallel="ddp"))
    assert line == ("out of memory in the LM head (Tried to allocate 2.00 GiB); to take less: --device_batch_size 4; "
                    "nothing was saved for this step: resume from the last checkpoint with --resume latest")
    flags = dict(activation_checkpointing=True, parallel="fsdp")  # both already on: not suggested
    assert oom.out_of_memory_line(cpu, progress.phase_of(cpu), flags) == ("out of memory (RuntimeError); to take "
                                                                          "less: a smaller --device_batch_size")
    try:  # LoRA's remedy where LoRA is off; under LoRA neither it nor fsdp (refused beside it) is offered
        with progress.doing("the optimizer step", (oom.FEWER_RANKS_STATE, oom.LORA_STATE)):
            raise torch.OutOfMemoryError("CUDA out of memory.")
    except torch.OutOfMemoryError as e:
        off, on = (oom.out_of_memory_line(e, progress.phase_of(e), dict(activation_checkpointing=False, parallel="ddp",
                                                                        lora_r=r)) for r in (0, 8))
    assert "--parallel fsdp (" in off and "--lora_r 16 (LoRA: " in off
    assert on.startswith("out of memory in the optimizer step (OutOfMemoryError); to take less: a smaller model or a "
                         "larger GPU;")
