"""Reward-model checkpoints that travel: found again after a move, refused with the wrong backbone, and
GRPO resumes refused when the source policy changed."""
from __future__ import annotations

import json
import shutil

import pytest

from nanochat_ext.errors import InputError
from nanochat_ext.models.reward_model import load_reward_model
from nanochat_ext.runtime.checkpoint import find_checkpoint
from nanochat_ext.tasks import synthetic
from scripts import kat_export_rm, kat_train_grpo, kat_train_rm


@pytest.fixture()
def trained(assets, tmp_path, monkeypatch):
    """A base dir holding a backbone, its tokenizer and an RM trained on it, as the speedrun lays them out."""
    base = tmp_path / "base"
    shutil.copytree(assets["gpt"], base / "chatsft_checkpoints" / "default")
    shutil.copytree(assets["tokenizer"], base / "tokenizer")
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    rm = base / "rm_checkpoints" / "uniform"
    assert kat_train_rm.main(["--backbone", str(base / "chatsft_checkpoints" / "default"),
                              "--pairs", str(assets["pairs"]),
                              "--max_steps", "3", "--batch_size", "8", "--max_len", "64", "--unfreeze_last", "1",
                              "--device", "cpu", "--out", str(rm)]) == 0
    fresh = synthetic.make_pairs(8, seed=3)
    return base, rm, [r["prompt"] for r in fresh], [r["chosen"] for r in fresh]


def test_a_moved_rm_finds_its_backbone_and_scores_identically(trained, tmp_path, monkeypatch):
    base, rm, prompts, responses = trained
    before = load_reward_model(rm).score(prompts, responses)
    ref = json.loads(find_checkpoint(rm)[1].read_text())["backbone_ref"]
    assert ref["given"] == str(base / "chatsft_checkpoints" / "default")
    assert ref["relative_to_checkpoint"] == "../../chatsft_checkpoints/default/model_0.pt"
    assert ref["relative_to_base_dir"] == "chatsft_checkpoints/default/model_0.pt"
    moved = tmp_path / "moved_base"
    shutil.move(base, moved)  # the whole base dir: the RM finds the backbone beside itself
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(moved))
    assert load_reward_model(moved / "rm_checkpoints" / "uniform").score(prompts, responses) == before
    elsewhere = tmp_path / "shared" / "my_rm"  # the RM alone, elsewhere: found under $NANOCHAT_BASE_DIR
    shutil.copytree(moved / "rm_checkpoints" / "uniform", elsewhere)
    assert load_reward_model(elsewhere).score(prompts, responses) == before
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(InputError, match="give its path \\(--rm_backbone\\)"):
        load_reward_model(elsewhere)
    override = load_reward_model(elsewhere, backbone=moved / "chatsft_checkpoints" / "default")
    assert override.score(prompts, responses) == before


def test_a_replaced_backbone_is_refused_and_an_old_meta_warns(trained, tmp_path, capsys):
    base, rm, prompts, responses = trained
    backbone = base / "chatsft_checkpoints" / "default"
    original = find_checkpoint(backbone)[0]
    kept = tmp_path / "original.pt"
    shutil.copyfile(original, kept)
    other = synthetic.make_tiny_gpt(tmp_path / "other", 512, seed=7)  # same shape, other weights
    shutil.copyfile(find_checkpoint(other)[0], original)
    with pytest.raises(InputError,
                       match=f"the backbone {original} is not the one this RM was trained on .*fingerprint"):
        load_reward_model(rm)
    shutil.copyfile(kept, original)
    meta_path = find_checkpoint(rm)[1]
    meta = json.loads(meta_path.read_text())
    del meta["backbone_ref"], meta["tokenizer_ref"]  # as written before fingerprints
    meta_path.write_text(json.dumps(meta))
    load_reward_model(rm)
    assert "predates backbone fingerprints: the backbone" in capsys.readouterr().out


def test_grpo_resume_refuses_a_changed_source_policy(assets, tmp_path, capsys):
    policy = tmp_path / "policy"
    shutil.copytree(assets["gpt"], policy)
    out = tmp_path / "grpo"
    args = ["--policy", str(policy), "--tokenizer", str(assets["tokenizer"]), "--prompts", str(assets["pairs"]),
            "--reward_fn", "rewards_for_tests:vowel_share", "--batch_size", "2", "--group_size", "2",
            "--max_new_tokens", "4", "--max_steps", "2", "--device", "cpu", "--out", str(out)]
    assert kat_train_grpo.main(args) == 0
    other = synthetic.make_tiny_gpt(tmp_path / "other", 512, seed=7)
    shutil.copyfile(find_checkpoint(other)[0], find_checkpoint(policy)[0])
    capsys.readouterr()
    assert kat_train_grpo.main(args + ["--resume", "latest"]) == 2
    assert "is not the policy this run started from: its weights changed" in capsys.readouterr().err


def test_an_exported_rm_loads_with_nothing_else_and_scores_identically(trained, tmp_path, monkeypatch):
    base, rm, prompts, responses = trained
    before = load_reward_model(rm).score(prompts, responses)
    export = tmp_path / "export"
    assert kat_export_rm.main(["--rm", str(rm), "--out", str(export)]) == 0
    assert sorted(p.name for p in export.iterdir() if p.is_dir()) == ["backbone", "tokenizer"]
    shutil.rmtree(base)  # the original backbone, tokenizer and RM are gone
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "nowhere"))
    assert load_reward_model(export).score(prompts, responses) == before
    assert kat_export_rm.main(["--rm", str(export), "--out", str(export)]) == 2  # not into a non-empty dir
