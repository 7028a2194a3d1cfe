"""kat_sft, nanochat's chat SFT on our trainer: N ranks (DDP and FSDP) = 1 rank, and an exact resume, on nanochat's
current vintage at 4 layers (tests/fixtures/nanochat-golden/current-d4)."""
from __future__ import annotations

import json

import torch
from conftest import assert_bitwise, assert_same_update, run_script
from test_nanochat_vintages import fixture_dir

from nanochat_ext.models.loader import load_backbone
from nanochat_ext.runtime.checkpoint import find_checkpoint
from nanochat_ext.tasks import synthetic
from scripts import kat_sft

NANOCHAT = fixture_dir("current-d4")


def sft_args(conversations, out, *extra) -> list[str]:
    return ["--backbone", str(NANOCHAT), "--conversations", str(conversations), "--batch_size", "8", "--max_steps",
            "4", "--lr", "1e-3", "--warmup_steps", "0", "--log_every", "1", "--max_len", "64", "--device", "cpu",
            "--out", str(out), *extra]


def test_sft_on_two_ranks_ddp_and_fsdp_trains_as_one_rank_and_resumes_exactly(tmp_path, capsys):
    """One rank, 2 DDP ranks and 2 FSDP ranks (2 micro-batches each) end with the same weights, every tensor
    trained; one rank resumed from its step-2 checkpoint ends bitwise where it did straight through, in nanochat's
    own layout (the fixture's keys, shapes and dtypes)."""
    conversations = synthetic.write_jsonl(tmp_path / "sft.jsonl", synthetic.make_conversations(64, 0))
    one = tmp_path / "one"
    assert kat_sft.main(sft_args(conversations, one, "--save_every", "2")) == 0
    for mode in ("ddp", "fsdp"):
        proc = run_script("scripts.kat_sft", sft_args(conversations, tmp_path / mode, "--device_batch_size", "2",
                                                      "--parallel", mode), nproc=2)
        assert proc.returncode == 0, proc.stderr[-2000:]
    trained = {run: load_backbone(tmp_path / run).model.state_dict() for run in ("one", "ddp", "fsdp")}
    init = load_backbone(NANOCHAT).model.state_dict()
    for a, b in (("one", "ddp"), ("one", "fsdp"), ("ddp", "fsdp")):
        assert_same_update(trained[b], trained[a], init)

    meta = next(m for m in one.glob("meta_*.json") if json.loads(m.read_text())["step"] == 2)
    step2 = meta.with_name(meta.name.replace("meta_", "model_").replace(".json", ".pt"))
    resumed = tmp_path / "resumed"
    capsys.readouterr()
    assert kat_sft.main(sft_args(conversations, resumed, "--resume", str(step2))) == 0
    assert f"resume: from {step2} at step 2" in capsys.readouterr().out
    again = load_backbone(resumed).model.state_dict()
    assert_bitwise(again, trained["one"])
    saved = torch.load(find_checkpoint(resumed)[0], weights_only=True)
    golden = torch.load(find_checkpoint(NANOCHAT)[0], weights_only=True)
    assert {k: (v.shape, v.dtype) for k, v in saved.items()} == {k: (v.shape, v.dtype) for k, v in golden.items()}
