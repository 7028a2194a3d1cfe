"""The optimizers the trainers build: AdamW against torch's reference implementation, and --optimizer muon against
nanochat's own optimizer (its groups and its steps, golden), on 1 and 2 ranks and resumed."""
import dataclasses
import math
import re

import pytest
import torch
from conftest import REPO, assert_same_update, run_script
from test_nanochat_vintages import FIXTURES, fixture_dir, vintage_of

from nanochat_ext import api
from nanochat_ext.algorithms.trainers import SPECS
from nanochat_ext.tasks.synthetic import make_pairs, write_jsonl
from nanochat_ext.training import optim
from nanochat_ext.training.optim import LR_CLIFF_PARAMS, OptimConfig, lr_multiplier, lr_warning, make_adamw
from scripts import kat_train_grpo


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


def test_the_lr_schedule_warms_up_linearly_then_decays_by_a_cosine_to_a_tenth():
    """lr_multiplier against values worked out by hand: 2 warm-up steps of 10, then 8 of cosine decay to 0.1."""
    got = [lr_multiplier(step, 10, 2) for step in range(11)]
    want = [0.5, 1.0, 1.0, 0.1 + 0.45 * (1 + math.cos(math.pi / 8)), 0.1 + 0.45 * (1 + math.sqrt(0.5)),
            0.1 + 0.45 * (1 + math.cos(3 * math.pi / 8)), 0.55, 0.1 + 0.45 * (1 - math.cos(3 * math.pi / 8)),
            0.1 + 0.45 * (1 - math.sqrt(0.5)), 0.1 + 0.45 * (1 - math.cos(math.pi / 8)), 0.1]
    assert got == pytest.approx(want, abs=1e-12)
    assert [lr_multiplier(step, 3, 0) for step in range(3)] == pytest.approx([1.0, 0.775, 0.325], abs=1e-12)


# ---- --optimizer muon: nanochat's own MuonAdamW ------------------------------------------------------------------
GOLDEN_OPTIM = REPO / "tests" / "fixtures" / "nanochat-optimizer" / "optim_golden.pt"  # its README.txt: what it holds
GOLDEN_D4 = fixture_dir("current-d4")  # 4 layers: backout acts before the last block


@pytest.mark.parametrize("setting", ["chat_rl", "wd"])
def test_muon_steps_as_nanochats_own_optimizer(setting):
    """Three steps of nanochat's own setup_optimizer + MuonAdamW (92d63d4, run by nanochat's code on the d4 fixture:
    optim_golden.pt) retraced from the same start and gradients, at chat_rl's rates x 0.05 without weight decay and
    at full rates with the matrices' weight decay 0.2 (the cautious decay). Our groups are nanochat's, name by name,
    with every hyperparameter; every tensor, in every group, moves as nanochat moved it, compared by the update of
    each step. Measured on CPU (fp32), the largest over tensors and steps: AdamW groups 2.5e-6 (the scalars bitwise),
    Muon 6.1e-5 under chat_rl's small steps and 1.4e-5 under 'wd'. That is fp32 rounding: the same algorithm in
    fp64 is further from nanochat's numbers (2.6e-5 to 1.4e-4); chat_rl's steps are so small beside the weights
    that rounding the weights to fp32 is a visible part of them. torch's Muon (the optimizer before this one) fails
    it: up to 2.3 times nanochat's update apart (the ve_gate matrices; 1.1 to 1.5 on the others)."""
    from nanochat_ext.models.loader import load_backbone
    from nanochat_ext.training.muon import MuonAdamW
    from nanochat_ext.training.optim import make_optimizer

    golden = torch.load(GOLDEN_OPTIM, weights_only=True)
    cfg = golden["settings"][setting]
    model = load_backbone(GOLDEN_D4).model
    params = dict(model.named_parameters())
    assert list(params) == golden["names"]
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(golden["start"][name])
    optimizer = make_optimizer("muon", model, [], cfg["init_lr_frac"], cfg["weight_decay"], torch.device("cpu"))
    assert isinstance(optimizer, MuonAdamW) and optimizer.orthogonalise_in == torch.float32
    names = {id(p): n for n, p in params.items()}
    hyper = ("kind", "betas", "eps", "weight_decay", "momentum", "ns_steps", "beta2")
    lrs = lambda groups: [(g["lr"], g["initial_lr"]) for g in groups]  # noqa: E731
    assert lrs(optimizer.param_groups) == [pytest.approx(x, rel=1e-15) for x in lrs(golden["groups"][setting])]
    ours = [{**{k: list(v) if k == "betas" else v for k, v in g.items() if k in hyper},
             "names": [names[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
    assert ours == [{k: v for k, v in g.items() if k not in ("lr", "initial_lr")} for g in golden["groups"][setting]]

    kind_of = {n: g["kind"] for g in golden["groups"][setting] for n in g["names"]}
    before = golden["start"]
    for step in range(golden["steps"]):
        for group in optimizer.param_groups:  # chat_rl's lrm = 1 - it / num_steps
            group["lr"] = group["initial_lr"] * (1 - step / golden["steps"])
        for name, p in params.items():
            p.grad = golden["grads"][step][name].clone()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        after = golden["after"][setting][step]
        for name, p in params.items():
            moved = float((after[name].double() - before[name].double()).norm())
            gap = float((p.detach().double() - after[name].double()).norm()) / moved
            allowed = 1e-5 if kind_of[name] == "adamw" else 1e-4
            assert gap <= allowed, f"step {step + 1}, {name} ({kind_of[name]}): {gap:.2e} of nanochat's update"
        before = after


@pytest.mark.parametrize("name", FIXTURES)
def test_muon_groups_hold_every_parameter_of_every_vintage(name):
    """Older vintages lack the lambdas, value embeddings or smear: their groups are left out, every parameter is in
    exactly one group (nanochat_groups refuses otherwise), and the blocks' matrices are in Muon groups of one shape
    each, as nanochat stacks them."""
    from nanochat_ext.models.loader import load_backbone
    from nanochat_ext.training.optim import nanochat_groups

    model = load_backbone(fixture_dir(name), vintage=vintage_of(name)).model
    groups = nanochat_groups(model, 0.05)
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    muon = [g for g in groups if g["kind"] == "muon"]
    assert sorted(id(p) for g in muon for p in g["params"]) == sorted(id(p) for p in model.transformer.h.parameters())
    assert all(len({p.shape for p in g["params"]}) == 1 and g["params"][0].dim() == 2 for g in muon)


def muon_args(assets, out, *extra) -> list[str]:
    prompts = out.parent / "prompts.jsonl"
    if not prompts.exists():
        write_jsonl(prompts, [{"prompt": r["prompt"]} for r in make_pairs(40, seed=2)])
    return ["--policy", str(GOLDEN_D4), "--prompts", str(prompts),
            "--reward_fn", "rewards_for_tests:vowel_share", "--optimizer", "muon", "--batch_size", "4",
            "--group_size", "4", "--max_new_tokens", "8", "--val_ratio", "0", "--beta", "0.04", "--device", "cpu",
            "--out", str(out), *extra]


def test_muon_on_two_ranks_trains_as_one_rank_and_resumes_exactly(assets, tmp_path):
    env = {"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
    small = ("--max_steps", "2", "--lr", "0.002")  # nanochat's learning rates / 25
    # one rank in this process (a launch would cost more than its two steps), as the resumed runs below
    assert kat_train_grpo.main(muon_args(assets, tmp_path / "one", *small)) == 0
    two = run_script("scripts.kat_train_grpo", muon_args(assets, tmp_path / "two", *small, "--device_batch_size", "4"),
                     nproc=2, env=env)
    assert two.returncode == 0, two.stderr[-2000:]
    from nanochat_ext.models.loader import load_backbone

    a, b = load_backbone(tmp_path / "one").model.state_dict(), load_backbone(tmp_path / "two").model.state_dict()
    init = load_backbone(GOLDEN_D4).model.state_dict()
    # Every tensor trains, in its group, and agrees (backout_lambda too: at 4 layers it acts before the last block).
    # On CPU the orthogonalisation is fp32 (torch's Muon, before, did it in bf16: 1.3e-2); measured: 1.0e-4 of the
    # update, the splits' float rounding grown through the Polar Express iterations.
    assert_same_update(b, a, init, rel=1e-3)
    # resume: 1 step, saved, then the second from the checkpoint = the two straight
    crashed = tmp_path / "crashed"
    assert kat_train_grpo.main(muon_args(assets, crashed, *small, "--save_every", "1")) == 0
    stamps = sorted(int(p.stem.split("_")[1]) for p in crashed.glob("model_*.pt"))
    for name in (f"model_{stamps[-1]}.pt", f"meta_{stamps[-1]}.json", f"state_{stamps[-1]}.pt"):
        (crashed / name).unlink()
    assert kat_train_grpo.main(muon_args(assets, crashed, *small, "--resume", "latest")) == 0
    for name, p in load_backbone(crashed).model.state_dict().items():
        torch.testing.assert_close(p, a[name], atol=0, rtol=0, msg=name)


def test_muon_refuses_what_is_not_a_nanochat_policy_and_a_resume_with_another_optimizer(assets, tmp_path, capsys):
    args = muon_args(assets, tmp_path / "hf", "--max_steps", "1")
    args[1] = str(assets["hf"])
    assert kat_train_grpo.main(args) == 2
    assert "--optimizer muon is nanochat's recipe for nanochat GPT policies; a Llama trains with --optimizer adamw" \
        in capsys.readouterr().err
    out = tmp_path / "m"
    assert kat_train_grpo.main(muon_args(assets, out, "--max_steps", "2", "--save_every", "1")) == 0
    adamw = muon_args(assets, out, "--max_steps", "3", "--resume", "latest", "--resume_extend")
    adamw[adamw.index("muon")] = "adamw"
    capsys.readouterr()
    assert kat_train_grpo.main(adamw) == 2
    assert "--optimizer is 'adamw' but the checkpoint was trained with 'muon'" in capsys.readouterr().err
    # a checkpoint of the earlier --optimizer muon (torch.optim.Muon + AdamW, saved as {'adamw', 'muon'}): its
    # moments are another algorithm's, so the resume stops in one line rather than mixing them in
    state_path = max(out.glob("state_*.pt"))
    state = torch.load(state_path, weights_only=False)
    matrices = [torch.nn.Parameter(torch.zeros(4, 4))]
    state["optimizer"] = {"adamw": torch.optim.AdamW(matrices).state_dict(),
                          "muon": torch.optim.Muon(matrices).state_dict()}
    torch.save(state, state_path)
    assert kat_train_grpo.main(muon_args(assets, out, "--max_steps", "3", "--resume", "latest",
                                         "--resume_extend")) == 2
    err = capsys.readouterr().err
    assert "optimizer state is the earlier --optimizer muon's (torch.optim.Muon + AdamW): nanochat's MuonAdamW " \
        "cannot continue another algorithm's state" in err and len(err.strip().splitlines()) == 1, err


def test_linear_decay_is_chat_rls_schedule():
    """--lr_decay linear: nanochat chat_rl's lrm = 1 - it / num_steps (after any warmup)."""
    assert [lr_multiplier(step, 4, 0, decay="linear") for step in range(4)] == [1.0, 0.75, 0.5, 0.25]
    assert [lr_multiplier(step, 4, 2, decay="linear") for step in range(4)] == [0.5, 1.0, 1.0, 0.5]


def test_a_full_fine_tune_at_its_trainers_measured_cliff_is_warned_about(assets, tmp_path, capfd, monkeypatch):
    """An AdamW --lr at or above the trainer's cliff on SmolLM2 (its TrainerSpec.lr_cliff, from bench/lr_sweep.sh) is
    one warning line for a model of SmolLM2's size or more; below it, on a far smaller model, with LoRA or Muon: none.
    No default --lr reaches its trainer's cliff. A DPO run prints the line (the tiny model counted as large enough)."""
    size = LR_CLIFF_PARAMS
    specs = {re.search(r"algorithms\.(\w+) import [^\n]*\bSPEC\b", f.read_text()).group(1)
             for f in (REPO / "nanochat_ext" / "recipes").glob("*.py")
             if "PolicyTraining(" in f.read_text()}
    assert {n for n in specs if SPECS[n].lr_cliff} == specs == {"sft", "dpo", "grpo"}  # each policy trainer's cliff
    for trainer in specs:
        (cliff, _), spec = SPECS[trainer].lr_cliff, SPECS[trainer]
        assert spec.defaults["lr"] < cliff, trainer
        adamw = dataclasses.replace(OptimConfig(), lr=cliff)
        said = lr_warning(trainer, spec.lr_cliff, adamw, size, lora=False)
        assert said.startswith(f"warning: --lr {cliff:g} is at or above") and "#learning-rate" in said
        assert lr_warning(trainer, spec.lr_cliff, dataclasses.replace(adamw, lr=cliff * 3), size, lora=False)
        assert lr_warning(trainer, spec.lr_cliff, dataclasses.replace(adamw, lr=cliff * 0.9), size, lora=False) is None
        assert lr_warning(trainer, spec.lr_cliff, adamw, size - 1, lora=False) is None
        assert lr_warning(trainer, spec.lr_cliff, adamw, size, lora=True) is None
        muon = dataclasses.replace(adamw, optimizer="muon")
        assert lr_warning(trainer, spec.lr_cliff, muon, size, lora=False) is None
    cliff = SPECS["dpo"].lr_cliff[0]
    dpo = {"policy": str(assets["gpt"]), "pairs": str(assets["pairs"]), "lr": cliff, "max_steps": 1, "batch_size": 4,
           "val_ratio": 0, "eval_every": 0, "save_every": 0, "device": "cpu"}
    api.train_dpo(**dpo, out=str(tmp_path / "small"))
    assert "warning: --lr" not in capfd.readouterr().out  # the tiny model: the cliff says nothing of it
    monkeypatch.setattr(optim, "LR_CLIFF_PARAMS", 0)
    api.train_dpo(**dpo, out=str(tmp_path / "large"))
    assert [line for line in capfd.readouterr().out.splitlines() if line.startswith("warning: --lr")] == [
        lr_warning("dpo", SPECS["dpo"].lr_cliff, dataclasses.replace(OptimConfig(), lr=cliff), LR_CLIFF_PARAMS,
                   lora=False)]
