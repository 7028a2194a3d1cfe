"""The optimizers the trainers build: AdamW against torch's reference implementation, and --optimizer muon against
nanochat's own parameter groups, on 1 and 2 ranks and resumed."""
import json
import math

import pytest
import torch

from conftest import REPO, assert_same_update, run_script
from nanochat_ext.optim import lr_multiplier, make_adamw
from nanochat_ext.synthetic import make_pairs, write_jsonl
from scripts import kat_train_grpo
from test_nanochat_vintages import FIXTURES, fixture_dir, vintage_of


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


# ---- --optimizer muon: nanochat's recipe with torch's Muon -------------------------------------------------------
MUON_FIXTURE = REPO / "tests" / "fixtures" / "nanochat-optimizer" / "groups.json"
GOLDEN_CURRENT = REPO / "tests" / "fixtures" / "nanochat-golden" / "current" / "chatsft_checkpoints" / "d2"
GOLDEN_D4 = fixture_dir("current-d4")  # 4 layers: backout acts before the last block


def test_muon_groups_are_nanochats():
    """Every parameter of the golden current-vintage checkpoint in the group, with the learning rate, betas, eps
    and weight decay, that nanochat's own setup_optimizer and chat_rl.py give it (groups.json, made by nanochat's
    code: make_groups.py). nanochat splits its Muon parameters by shape for stacking; torch's Muon takes them in one
    group with the same hyperparameters."""
    from nanochat_ext.loader import load_backbone
    from nanochat_ext.optim import nanochat_groups

    model = load_backbone(GOLDEN_CURRENT).model
    names = {id(p): n for n, p in model.named_parameters()}
    adamw, muon = nanochat_groups(model, lr_frac=0.05)  # chat_rl.py's --init-lr-frac
    ours = {names[id(p)]: ("adamw", g) for g in adamw for p in g["params"]}
    ours.update({names[id(p)]: ("muon", g) for g in muon for p in g["params"]})
    want = json.loads(MUON_FIXTURE.read_text())
    assert sorted(ours) == sorted(n for g in want for n in g["params"])
    for g in want:
        for name in g["params"]:
            kind, mine = ours[name]
            assert kind == g["kind"] and mine["lr"] == pytest.approx(g["lr"], rel=1e-12), name
            assert mine["weight_decay"] == g["weight_decay"], name
            if kind == "adamw":
                assert list(mine["betas"]) == g["betas"] and mine["eps"] == g["eps"], name
            else:
                assert (mine["momentum"], mine["ns_steps"]) == (g["momentum"], g["ns_steps"]), name


@pytest.mark.parametrize("name", FIXTURES)
def test_muon_groups_hold_every_parameter_of_every_vintage(name):
    """Older vintages lack the lambdas, value embeddings or smear: their groups are left out, and every parameter is
    in exactly one group (nanochat_groups refuses otherwise)."""
    from nanochat_ext.loader import load_backbone
    from nanochat_ext.optim import nanochat_groups

    model = load_backbone(fixture_dir(name), vintage=vintage_of(name)).model
    adamw, muon = nanochat_groups(model, 0.05)
    assert sum(len(g["params"]) for g in adamw + muon) == len(list(model.parameters()))
    assert [id(p) for p in muon[0]["params"]] == [id(p) for p in model.transformer.h.parameters()]


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
    one = run_script("scripts.kat_train_grpo", muon_args(assets, tmp_path / "one", *small), env=env)
    two = run_script("scripts.kat_train_grpo", muon_args(assets, tmp_path / "two", *small, "--device_batch_size", "4"),
                     nproc=2, env=env)
    assert one.returncode == 0, one.stderr[-2000:]
    assert two.returncode == 0, two.stderr[-2000:]
    from nanochat_ext.loader import load_backbone

    a, b = load_backbone(tmp_path / "one").model.state_dict(), load_backbone(tmp_path / "two").model.state_dict()
    init = load_backbone(GOLDEN_D4).model.state_dict()
    # Every tensor trains, in its group, and agrees (backout_lambda too: at 4 layers it acts before the last block).
    # Muon orthogonalises each update in bf16 (torch.optim.Muon's Newton-Schulz iterations), where the splits'
    # float rounding shows at bf16's precision (2^-8): measured up to 1.3e-2 of the update (a rank's gradient left
    # out: 0.17).
    assert_same_update(b, a, init, rel=5e-2)
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


def test_linear_decay_is_chat_rls_schedule():
    """--lr_decay linear: nanochat chat_rl's lrm = 1 - it / num_steps (after any warmup)."""
    assert [lr_multiplier(step, 4, 0, decay="linear") for step in range(4)] == [1.0, 0.75, 0.5, 0.25]
    assert [lr_multiplier(step, 4, 2, decay="linear") for step in range(4)] == [0.5, 1.0, 1.0, 0.5]
