"""DPO (scripts/kat_train_dpo.py, nanochat_ext/algorithms/dpo.py): its losses and their gradients against TRL 1.16's own
code (tests/fixtures/trl-golden/make_dpo_golden.py) on ragged pairs, and the metrics TRL's DPOTrainer logs."""
from __future__ import annotations

import contextlib
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import assert_bitwise, assert_same_update, run_script, ulps

from nanochat_ext.algorithms.dpo import (
    DPO_STATS,
    DPOConfig,
    PairBatch,
    dpo_backward,
    dpo_losses,
    dpo_metrics,
    pair_sequences,
    pair_stats,
    sequence_logps,
)
from nanochat_ext.data.batching import tokenize_pairs
from nanochat_ext.data.rows import load_pairs
from nanochat_ext.models.loader import load_backbone, load_tokenizer_for
from nanochat_ext.runtime.checkpoint import find_checkpoint
from nanochat_ext.tasks import synthetic
from nanochat_ext.training.logprobs import CompletionLogprobs, make_sequences
from scripts import kat_train_dpo

GOLDEN = torch.load(Path(__file__).parent / "fixtures" / "trl-golden" / "dpo_golden.pt", weights_only=True)
CASES = {"sigmoid": ("sigmoid", 0.0), "ipo": ("ipo", 0.0), "hinge": ("hinge", 0.0),
         "sigmoid/smoothing_0.1": ("sigmoid", 0.1), "simpo": ("simpo", 0.0), "simpo/smoothing_0.1": ("simpo", 0.1)}


def interleaved(compact: torch.Tensor) -> torch.Tensor:
    """TRL's rows (P chosen, then P rejected) as ours: pair i's chosen at 2i, its rejected at 2i + 1."""
    P = compact.size(0) // 2
    return torch.stack([compact[:P], compact[P:]], 1).flatten(0, 1)


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradient_equal_trls(case):
    g = GOLDEN
    loss_type, smoothing = CASES[case]
    mask = interleaved(g["mask"])
    assert mask.sum(1).unique().numel() > 4 and (mask.sum(1) == 1).any()  # ragged, one-token responses too
    cfg = DPOConfig(loss_type, beta=g["beta"], label_smoothing=smoothing, simpo_gamma=g["simpo_gamma"])
    logp = interleaved(g["logp"]).clone().requires_grad_(True)
    logps, n_tokens = sequence_logps(logp, mask)
    losses, rewards = dpo_losses(logps, interleaved(g["ref"]).view(-1, 2), n_tokens, cfg)
    loss = losses.mean()  # uniform weights, mean mode: sum(w * loss) / sum(w)
    loss.backward()
    want = g["loss"][case]
    torch.testing.assert_close(loss.detach(), want["loss"], atol=1e-6, rtol=0)
    torch.testing.assert_close(logp.grad, interleaved(want["grad"]), atol=1e-7, rtol=0)
    if "rewards" in want:
        torch.testing.assert_close(rewards, want["rewards"], atol=1e-6, rtol=0)
    if "metrics" in want:  # TRL's logged means, from our summed stats
        b = PairBatch(tokens=torch.zeros(1), computed=torch.zeros(1))
        stats = dict(zip(DPO_STATS[1:], pair_stats(rewards, logps, b).tolist()))
        ours = dpo_metrics(stats)
        for name, value in want["metrics"].items():
            assert ours[name] == pytest.approx(value, abs=1e-6), name



def test_pair_logps_on_a_hugging_face_llama_equal_transformers_forward(assets):
    """The sequence log-probs DPO trains on, computed as kat_train_dpo computes them (each pair one prefix-tree row,
    the native Llama), against transformers' own LlamaForCausalLM on each prompt + response alone, on ragged pairs;
    and the loss from them against the TRL-checked formula applied to transformers' log-probs."""
    from transformers import AutoModelForCausalLM

    policy = load_backbone(assets["hf"])
    assert policy.native
    tok = load_tokenizer_for(policy, None)
    pairs, _ = tokenize_pairs(load_pairs(assets["pairs"])[0][:6], tok, 64)
    assert len({len(p.chosen) for p in pairs}) > 2 and len({p.prompt_len for p in pairs}) > 1  # ragged
    batch = pair_sequences(pairs, tok.pad_id)
    with torch.no_grad():
        logp, _ = CompletionLogprobs(policy)(batch.input_ids, batch.gather, batch.target, batch.branches)
    ours, n_tokens = sequence_logps(logp, batch.mask)
    hf = AutoModelForCausalLM.from_pretrained(str(assets["hf"]), dtype=torch.float32).eval()
    want = []
    with torch.no_grad():
        for p in pairs:
            for seq in (p.chosen, p.rejected):
                ids = torch.tensor([seq])
                token_logp = torch.log_softmax(hf(ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
                want.append(token_logp[p.prompt_len - 1:].sum())
    want = torch.stack(want).view(-1, 2)
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-5)
    ref = want.flip(1)  # any reference: the rejected's log-probs as the chosen's and back
    cfg = DPOConfig("sigmoid", beta=0.5)
    torch.testing.assert_close(dpo_losses(ours, ref, n_tokens, cfg)[0], dpo_losses(want, ref, n_tokens, cfg)[0],
                               atol=1e-5, rtol=0)

# ---- the trainer --------------------------------------------------------------------------------
def dpo_args(assets, out, *extra) -> list[str]:
    return ["--policy", str(assets["gpt"]), "--tokenizer", str(assets["tokenizer"]), "--pairs", str(assets["pairs"]),
            "--batch_size", "8", "--max_len", "64", "--device", "cpu", "--eval_every", "0", "--log_every", "1",
            "--lr", "1e-3", "--out", str(out), *extra]


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]


def test_learns_the_preference_and_logs_what_trl_logs(assets, tmp_path):
    """DPO moves the policy toward the chosen responses: held-out preference accuracy and reward margins rise,
    logged under TRL's names; the policy saved loads again as a policy."""
    out = tmp_path / "dpo"
    assert kat_train_dpo.main(dpo_args(assets, out, "--max_steps", "30", "--batch_size", "16",
                                       "--eval_every", "30", "--log_every", "10")) == 0
    logged = metrics(out)
    train = [m for m in logged if "train/loss" in m]
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                 "logps/rejected", "perf/pairs_per_s"):
        assert name in train[-1], name
    assert train[-1]["train/loss"] < train[0]["train/loss"] < math.log(2) + 1e-3
    assert train[-1]["rewards/margins"] > 0
    val = next(m for m in logged if "val/rewards/accuracies" in m)
    assert val["val/rewards/accuracies"] >= 0.9 and val["val/rewards/margins"] > 0, val
    _, meta = find_checkpoint(out)
    assert json.loads(meta.read_text())["kind"] == "dpo_policy"
    trained = load_backbone(out).model.state_dict()
    init = load_backbone(assets["gpt"]).model.state_dict()
    assert any(not torch.equal(trained[k], init[k]) for k in init)


def test_weighted_loss_over_micro_batches_is_the_global_formula(assets):
    """dpo_backward's loss is sum_i w_i loss_i / sum_i w_i over the whole batch, each loss_i dpo_losses' of the pair's
    own sequence log-probs (the oracle: the model's log-probs of each pair computed alone), and its gradient does not
    depend on the micro-batches."""
    tok = load_tokenizer_for(load_backbone(assets["gpt"]), assets["tokenizer"])
    rows = load_pairs(assets["pairs"])[0][:6]
    pairs, _ = tokenize_pairs(rows, tok, 64)
    for i, p in enumerate(pairs):
        p.weight = 0.5 + i
    assert len({len(p.chosen) for p in pairs}) > 2  # ragged
    cfg = DPOConfig("sigmoid", beta=0.5)
    grads, losses = [], []
    for micro in (12, 4, 2):
        torch.manual_seed(0)
        policy = load_backbone(assets["gpt"])
        policy.set_trainable("all")
        model = CompletionLogprobs(policy)
        batch = pair_sequences(pairs, tok.pad_id)
        batch.ref = torch.linspace(-60, -40, 12)
        stats = dpo_backward(model, batch, micro, cfg, torch.device("cpu"), contextlib.nullcontext())
        losses.append(stats[0].item())
        grads.append({n: p.grad.clone() for n, p in policy.named_parameters()})
    alone = []
    with torch.no_grad():
        for i, p in enumerate(pairs):
            b = make_sequences([p.chosen[:p.prompt_len]], [p.chosen[p.prompt_len:], p.rejected[p.prompt_len:]], 2,
                               tok.pad_id)  # one row per response, no prefix tree
            logp, _ = model(b.input_ids, b.gather, b.target)
            logps, n = sequence_logps(logp, b.mask)
            alone.append(dpo_losses(logps, batch.ref[2 * i:2 * i + 2].view(1, 2), n, cfg)[0])
    w = torch.tensor([p.weight for p in pairs])
    want = float((w * torch.cat(alone)).sum() / w.sum())
    assert losses == pytest.approx([want] * 3, abs=1e-5)
    for g in grads[1:]:
        for k in g:
            torch.testing.assert_close(g[k], grads[0][k], atol=ulps(grads[0][k], n=64), rtol=1e-4)


def test_two_ranks_ddp_and_fsdp_with_density_weights_train_as_one_rank(assets, tmp_path):
    """1 rank, 2 DDP ranks in micro-batches with the reference's log-probs computed before training
    (--precompute_ref_logps), and 2 FSDP ranks with them computed each step, density weights on: the same update. The
    DDP ranks' default group serves only CUDA tensors (--backend cuda:gloo, NCCL's device rule on a CPU machine), so
    every collective DPO makes is held to that rule."""
    rows = load_pairs(assets["pairs"])[0]
    density = synthetic.write_jsonl(tmp_path / "density.jsonl", [
        {"prefix_id": p, "weight": 0.25 + (k % 5)} for k, p in enumerate(sorted({r.prefix_id for r in rows}))])
    common = ("--max_steps", "3", "--density", str(density), "--max_len", "48")
    assert kat_train_dpo.main(dpo_args(assets, tmp_path / "one", *common)) == 0
    env = {"OMP_NUM_THREADS": "1"}
    ddp = run_script("scripts.kat_train_dpo", dpo_args(assets, tmp_path / "ddp", *common, "--device_batch_size", "2",
                                                       "--precompute_ref_logps", "--backend", "cuda:gloo"),
                     nproc=2, env=env)
    assert ddp.returncode == 0, ddp.stderr
    assert "reference: log-probs of " in ddp.stdout
    fsdp = run_script("scripts.kat_train_dpo", dpo_args(assets, tmp_path / "fsdp", *common, "--parallel", "fsdp"),
                      nproc=2, env=env)
    assert fsdp.returncode == 0, fsdp.stderr
    init = load_backbone(assets["gpt"]).model.state_dict()
    want = load_backbone(tmp_path / "one").model.state_dict()
    for run in ("ddp", "fsdp"):
        assert_same_update(load_backbone(tmp_path / run).model.state_dict(), want, init)


def test_resume_continues_exactly_and_lora_starts_at_log_2(assets, tmp_path, capsys):
    """A run resumed from its step-2 checkpoint ends bitwise where the straight run does. The first step's loss is
    log 2 (every log-ratio 0): the reference computes as the policy does, a loaded copy or, under --lora_r, the policy
    with its adapters off."""
    args = ("--max_steps", "4")
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    assert kat_train_dpo.main(dpo_args(assets, straight, *args)) == 0
    assert kat_train_dpo.main(dpo_args(assets, crashed, *args, "--save_every", "2")) == 0
    stamp = find_checkpoint(crashed)[0].stem.split("_")[1]  # the run died after its step-2 checkpoint
    for path in crashed.glob(f"*_{stamp}.*"):
        path.unlink()
    assert kat_train_dpo.main(dpo_args(assets, crashed, *args, "--resume", "latest")) == 0
    assert "resume: from" in capsys.readouterr().out
    assert_bitwise(load_backbone(crashed).model.state_dict(), load_backbone(straight).model.state_dict())
    assert metrics(straight)[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-6)  # the reference is the policy
    lora = tmp_path / "lora"
    assert kat_train_dpo.main(dpo_args(assets, lora, "--max_steps", "2", "--lora_r", "4")) == 0
    assert "reference the base, adapters off" in capsys.readouterr().out
    assert metrics(lora)[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-6)


@pytest.mark.parametrize("extra,line", [
    (("--beta", "0"), "--beta must be a finite number > 0"),
    (("--loss_type", "ipo", "--label_smoothing", "0.1"), "--label_smoothing applies to --loss_type sigmoid and simpo"),
    (("--label_smoothing", "0.5"), "--label_smoothing must be in [0, 0.5)"),
    (("--reference", "SMALL"), "--reference is not --policy's architecture: its "),
    (("--loss_type", "simpo", "--reference", "GPT"), "--loss_type simpo uses no reference"),
    (("--loss_type", "simpo", "--precompute_ref_logps"), "--precompute_ref_logps: --loss_type simpo uses no reference"),
    (("--optimizer", "muon", "--policy", "HF"), "--optimizer muon is nanochat's recipe for nanochat GPT policies"),
    (("--pairs", "NO_CHOSEN"), ":2: field 'chosen': missing"),
])
def test_bad_input_is_one_line_and_writes_nothing(assets, tmp_path, capsys, extra, line):
    no_chosen = tmp_path / "pairs.jsonl"
    no_chosen.write_text('{"prompt": "Hi?", "chosen": "Yes.", "rejected": "No."}\n'
                         '{"prompt": "Hi?", "rejected": "No."}\n')
    names = {"SMALL": assets["gpt_small_vocab"], "GPT": assets["gpt"], "HF": assets["hf"], "NO_CHOSEN": no_chosen}
    args = dpo_args(assets, tmp_path / "out", "--max_steps", "1", *(str(names.get(x, x)) for x in extra))
    assert kat_train_dpo.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and line in err, err
    assert not (tmp_path / "out").exists()


def test_a_resumed_run_refuses_a_reference_whose_weights_changed(assets, tmp_path, capsys):
    ref = tmp_path / "ref"
    shutil.copytree(assets["gpt"], ref)
    args = dpo_args(assets, tmp_path / "out", "--max_steps", "1", "--reference", str(ref))
    assert kat_train_dpo.main(args) == 0
    weights = torch.load(ref / "model_0.pt", weights_only=True)
    first = next(iter(weights))
    weights[first] = weights[first] + 0.01  # the same architecture, other weights
    torch.save(weights, ref / "model_0.pt")
    capsys.readouterr()
    assert kat_train_dpo.main([*args, "--resume", "latest", "--max_steps", "2", "--resume_extend"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not the reference this run started from" in err, err
