"""DDP correctness of the reward-model trainer with real gloo process groups."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_stopped, rm_init, run_script, run_worker

from nanochat_ext.data.batching import collate_pairs, tokenize_pairs
from nanochat_ext.data.rows import load_pairs
from nanochat_ext.models.loader import load_backbone
from nanochat_ext.models.reward_model import RewardModel
from nanochat_ext.tokenizer import TokenizerWrapper


def rm_args(assets, out, *extra) -> list[str]:
    return ["--backbone", str(assets["gpt"]), "--tokenizer", str(assets["tokenizer"]),
            "--pairs", str(assets["pairs"]), "--batch_size", "8", "--max_steps", "6", "--unfreeze_last", "1",
            "--lr", "3e-3", "--eval_every", "0", "--log_every", "3", "--seed", "3", "--device", "cpu",
            "--max_len", "64", "--out", str(out), *extra]


def checkpoints(d):
    return sorted(d.glob("model_*.pt"))


def test_full_fine_tune_of_an_hf_backbone_on_two_ranks(assets, tmp_path):
    """--unfreeze_last all under DDP: every parameter the RM uses trains, the unused LM head stays frozen."""
    args = rm_args(assets, tmp_path / "all", "--unfreeze_last", "all", "--max_steps", "2")
    args[args.index("--backbone") + 1] = str(assets["hf"])
    del args[args.index("--tokenizer"):args.index("--tokenizer") + 2]
    proc = run_script("scripts.kat_train_rm", args, nproc=2)
    assert proc.returncode == 0, proc.stderr
    saved = torch.load(checkpoints(tmp_path / "all")[0], weights_only=True)
    assert "backbone.model.embed.weight" in saved and "backbone.model.layers.0.attn.qkv.weight" in saved
    assert not any("lm_head" in k for k in saved)
    init = rm_init(assets["hf"], seed=3)
    assert saved.keys() == {k for k in init if "lm_head" not in k}
    assert all(not torch.equal(saved[k], init[k]) for k in saved), [k for k in saved if torch.equal(saved[k], init[k])]


def test_loss_and_grads_invariant_to_ranks_and_micro_batches(assets, tmp_path):
    splits = {1: (1, 4), 2: (1, 2)}  # ranks: micro-batches per rank
    runs = {(n, m): r for n, micros in splits.items()
            for m, r in run_worker("rm_grad_worker", assets, n, micros, tmp_path / f"grads_{n}.pt").items()}
    reference = _reference_losses(assets)
    for mode in ("mean", "sum", "none"):
        base = runs[(1, 1)][mode]
        assert base["loss"] == pytest.approx(reference[mode], rel=1e-5)
        for key, run in runs.items():
            assert run[mode]["loss"] == pytest.approx(base["loss"], rel=1e-6), (mode, key)
            assert run[mode]["grads"].keys() == base["grads"].keys()
            for name, g in base["grads"].items():
                torch.testing.assert_close(run[mode]["grads"][name], g, atol=1e-6, rtol=1e-5,
                                           msg=f"{mode} {key} {name}")
    # The modes really differ (the weights matter), so the invariance above is not vacuous.
    assert runs[(1, 1)]["mean"]["loss"] != pytest.approx(runs[(1, 1)]["none"]["loss"], rel=1e-3)


def _reference_losses(assets) -> dict[str, float]:
    """The global-batch losses computed by hand from one unsplit forward pass."""
    backbone = load_backbone(assets["gpt"])
    tok = TokenizerWrapper.load(assets["tokenizer"])
    model = RewardModel(backbone)
    model.init_head(0)
    rows = load_pairs(assets["pairs"])[0][:8]
    for i, r in enumerate(rows):
        r.weight = 0.25 + 0.25 * i
    b = collate_pairs(tokenize_pairs(rows, tok, 64)[0], tok.pad_id)
    with torch.no_grad():
        r = model(b["input_ids"], b["lengths"])
    per_pair = -F.logsigmoid(r[:8] - r[8:]).double()
    capped = torch.minimum(b["weights"], torch.tensor(1.6)).double()  # weights are float32 in the batch
    assert capped.tolist()[-2:] == [pytest.approx(1.6)] * 2 and capped[0] == 0.25
    return {"mean": ((capped * per_pair).sum() / capped.sum()).item(),
            "sum": ((capped * per_pair).sum() / 8).item(),
            "none": per_pair.mean().item()}


def test_batch_that_does_not_split_over_ranks_is_an_error(assets, tmp_path):
    proc = run_script("scripts.kat_train_rm", rm_args(assets, tmp_path / "out", "--batch_size", "3"), nproc=2,
                      torchrun=True)
    assert_stopped(proc, 2, "--batch_size 3 does not split over 2 ranks", nproc=2)  # each rank finds it: said once
    assert not checkpoints(tmp_path / "out")
