"""--async_rollouts 1 (issue 82): the next step's rollout is sampled and scored in a thread while this step trains.
Its schedule is fixed: step t's rollout comes from the weights after step t-2 (the first two steps' from the starting
weights), checked against an engine decoding each draw from the checkpoint of those weights; 2 ranks sample what
1 rank samples and take the same update; a run cut at a checkpoint resumes, the draw in flight kept in it, to the
uninterrupted run's weights bitwise; --async_rollouts is a resume flag; 0 is the synchronous loop."""
from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from conftest import REPO, assert_same_update, run_script
from test_grpo import grpo_args, grpo_assets, read_metrics  # noqa: F401 (a fixture)

from nanochat_ext.agent.agent import Agent, AgentConfig
from nanochat_ext.algorithms.rollouts import Rollouts
from nanochat_ext.data.batching import encode_prompts
from nanochat_ext.data.rows import read_prompts
from nanochat_ext.engine.engine import Engine
from nanochat_ext.engine.sampling import SamplingConfig, sample_seed
from nanochat_ext.models.loader import load_backbone, load_tokenizer_for
from scripts import kat_train_grpo

COMMON = ("--reward_fn", "rewards_for_tests:vowel_share", "--batch_size", "4", "--group_size", "4", "--beta", "0.04",
          "--log_rollouts", "--log_every", "1", "--val_ratio", "0", "--seed", "3", "--lr", "3e-2")


def rollouts_by_step(out) -> dict[int, list[tuple[int, list[int]]]]:
    """Each step's logged (prompt, completion) pairs: its last run of lines (a resumed run logs a step anew)."""
    steps: dict[int, list] = {}
    previous = None
    for r in map(json.loads, (out / "logs" / "rollouts.jsonl").read_text().splitlines()):
        if r["step"] != previous:
            steps[r["step"]], previous = [], r["step"]
        steps[r["step"]].append((r["prompt_index"], r["completion_ids"]))
    return steps


def checkpoints(out) -> list:
    """The run's checkpoints' model files, oldest first (one a step with --save_every 1 --keep_last 0)."""
    return sorted(out.glob("model_*.pt"), key=lambda p: int(p.stem.split("_")[1]))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_a_steps_rollout_comes_from_the_weights_two_steps_before(assets, grpo_assets, tmp_path, device):
    """Each logged step's completions are what an engine decodes, with the run's seeds for that draw, from the weights
    after step max(0, t-2) (t counted from 1): the first two steps' from the starting policy, then the checkpoint one
    step older than the synchronous loop's. Decoding from the synchronous loop's weights instead gives other tokens:
    the check tells the two schedules apart. On a GPU (fp32) the thread decodes on a CUDA stream of its own while the
    training's kernels run on the default one: the same check holds there."""
    out = tmp_path / "async"
    argv = grpo_args(assets, grpo_assets, out, *COMMON, "--max_steps", "4", "--async_rollouts", "1",
                     "--save_every", "1", "--keep_last", "0", "--temperature", "1.0", "--dtype", "float32")
    argv[argv.index("--device") + 1] = device
    assert kat_train_grpo.main(argv) == 0
    logged = rollouts_by_step(out)
    metrics = [m for m in read_metrics(out) if "train/loss" in m]
    assert [m.get("train/staleness", 0.0) for m in metrics] == [0.0, 1.0, 1.0, 1.0]
    weights = [assets["gpt"], *checkpoints(out)]  # after 0, 1, 2, 3, 4 steps
    tok = load_tokenizer_for(load_backbone(assets["gpt"]), str(assets["tokenizer"]))
    rows, _ = read_prompts(str(grpo_assets["prompts"]), None, 0.0)
    ids = encode_prompts(rows, Agent(AgentConfig(), tok).render_prompt, 512, 8, None)

    def decoded(step: int, after: int) -> list[tuple[int, list[int]]]:
        indices = sorted({i for i, _ in logged[step]})
        engine = Engine(load_backbone(weights[after], torch.device(device)))
        samples = engine.generate([ids[i] for i in indices], 4, SamplingConfig(8, 1.0), tok.stop_ids, tok.pad_id,
                                  [torch.Generator().manual_seed(sample_seed(3, step - 1, i)) for i in indices])
        return [(i, c) for k, i in enumerate(indices) for c in samples.completions[4 * k:4 * k + 4]]

    for step in (1, 2, 3, 4):
        assert sorted(logged[step]) == sorted(decoded(step, max(0, step - 2))), step
    assert sorted(logged[4]) != sorted(decoded(4, 3))  # the synchronous loop's weights for step 4


def test_two_ranks_sample_and_step_as_one_and_a_cut_run_resumes_to_the_same_weights(assets, grpo_assets, tmp_path,
                                                                                    capsys):
    """1 rank = 2 ranks under --async_rollouts 1 (the rollouts equal, the update within today's tolerance); the
    two-rank run, its last checkpoint removed (a crash after step 2: the draw for step 3 in flight, kept in the
    checkpoint of step 2), resumes on one rank to the same update; a 1-rank run cut the same way resumes to the
    uninterrupted run's weights bitwise. Changing --async_rollouts on resume is refused in one line."""
    args = (*COMMON, "--max_steps", "3", "--async_rollouts", "1")
    one, two, cut = tmp_path / "one", tmp_path / "two", tmp_path / "cut"
    assert kat_train_grpo.main(grpo_args(assets, grpo_assets, one, *args)) == 0
    proc = run_script("scripts.kat_train_grpo", grpo_args(assets, grpo_assets, two, *args, "--save_every", "1"),
                      nproc=2, env={"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert rollouts_by_step(one) == rollouts_by_step(two)
    init = load_backbone(assets["gpt"]).model.state_dict()
    want = load_backbone(one).model.state_dict()
    assert_same_update(load_backbone(two).model.state_dict(), want, init)

    def crash_after_step_2(out) -> None:
        for path in (checkpoints(out)[-1], *(out / f"{kind}_{checkpoints(out)[-1].stem.split('_')[1]}.{ext}"
                                             for kind, ext in (("meta", "json"), ("state", "pt")))):
            path.unlink()

    crash_after_step_2(two)
    assert kat_train_grpo.main(grpo_args(assets, grpo_assets, two, *args, "--resume", "latest")) == 0
    assert_same_update(load_backbone(two).model.state_dict(), want, init)

    assert kat_train_grpo.main(grpo_args(assets, grpo_assets, cut, *args, "--save_every", "1")) == 0
    crash_after_step_2(cut)
    assert kat_train_grpo.main(grpo_args(assets, grpo_assets, cut, *args, "--resume", "latest")) == 0
    for name, p in load_backbone(cut).model.state_dict().items():
        torch.testing.assert_close(p, want[name], atol=0, rtol=0, msg=name)
    assert rollouts_by_step(cut)[3] == rollouts_by_step(one)[3]  # the draw kept in flight, not sampled again

    sync = [*args[:-1], "0"]  # --async_rollouts 0
    assert kat_train_grpo.main(grpo_args(assets, grpo_assets, cut, *sync, "--resume", "latest")) == 2
    assert "--async_rollouts is 0 but the checkpoint was trained with 1" in capsys.readouterr().err


@pytest.mark.parametrize("dynamic", [False, True], ids=["one_draw", "filter_zero_std"])
def test_with_weights_that_do_not_move_the_thread_samples_the_synchronous_loops_draws(assets, grpo_assets, tmp_path,
                                                                                      dynamic):
    """A reward of 0 and no KL: no gradient, so the weights never move and every draw, sampled ahead in the thread or
    in the step, comes from the same weights: the two loops log the same completions step by step (the thread takes
    the draws in order, with their own seeds, scored) and end at the starting weights. With --filter_zero_std every
    group is flat, so each step draws --max_draws batches and is topped up from the first: the thread numbers its
    draws as the synchronous loop does (step t's first is draw 3t)."""
    logged, draws, init = {}, {}, load_backbone(assets["gpt"]).model.state_dict()
    for k in ("0", "1"):
        out = tmp_path / f"async_{k}"
        argv = grpo_args(assets, grpo_assets, out, *COMMON, "--max_steps", "3", "--async_rollouts", k,
                         *(("--filter_zero_std", "--max_draws", "3") if dynamic else ()))
        argv[argv.index("rewards_for_tests:vowel_share")] = "rewards_for_tests:zero"
        argv[argv.index("--beta") + 1] = "0"
        assert kat_train_grpo.main(argv) == 0
        logged[k] = rollouts_by_step(out)
        draws[k] = [(m["train/draws"], m["train/filled_frac"]) for m in read_metrics(out) if "train/loss" in m]
        for name, p in load_backbone(out).model.state_dict().items():
            torch.testing.assert_close(p, init[name], atol=0, rtol=0, msg=name)
    assert logged["0"] == logged["1"] and sorted(logged["1"]) == [1, 2, 3]
    assert draws["0"] == draws["1"] == [(3.0, 1.0) if dynamic else (1.0, 0.0)] * 3


def test_dynamic_sampling_draws_ahead_on_one_or_two_ranks_and_a_cut_run_resumes(assets, grpo_assets, tmp_path):
    """--filter_zero_std under --async_rollouts 1: the thread draws until the next step's batch holds groups with a
    spread (about half the prompts get a constant reward), on the thread's own group across ranks. Every trained group
    has a spread and some steps took more than one draw; 2 ranks train the groups 1 rank trains and take the same
    update; the 2-rank run cut after step 2 (its next rollout in flight, and the draws it took, kept in the checkpoint)
    resumes on one rank to the same groups at step 3 and the same update."""
    args = ("--reward_fn", "rewards_for_tests:flat_for_even_prompts", "--filter_zero_std", "--max_draws", "8",
            *COMMON[2:], "--max_steps", "3", "--async_rollouts", "1")
    one, two = tmp_path / "one", tmp_path / "two"
    assert kat_train_grpo.main(grpo_args(assets, grpo_assets, one, *args)) == 0
    proc = run_script("scripts.kat_train_grpo", grpo_args(assets, grpo_assets, two, *args, "--save_every", "1"),
                      nproc=2, env={"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    trained = [json.loads(line) for line in (one / "logs" / "rollouts.jsonl").read_text().splitlines()]
    assert len(trained) == 3 * 4 * 4
    for k in range(0, len(trained), 4):
        assert len({r["reward"] for r in trained[k:k + 4]}) > 1, trained[k:k + 4]  # a spread in every group
    assert sum(m["train/draws"] for m in read_metrics(one) if "train/loss" in m) > 3
    assert rollouts_by_step(one) == rollouts_by_step(two)
    init = load_backbone(assets["gpt"]).model.state_dict()
    want = load_backbone(one).model.state_dict()
    assert_same_update(load_backbone(two).model.state_dict(), want, init)
    last = checkpoints(two)[-1].stem.split("_")[1]
    for name in (f"model_{last}.pt", f"meta_{last}.json", f"state_{last}.pt"):
        (two / name).unlink()
    # where the resumed run goes on drawing: after step 3's rollout, in flight when step 2's checkpoint was written
    state = torch.load(two / f"state_{checkpoints(two)[-1].stem.split('_')[1]}.pt", weights_only=True)
    assert state["step"] == 2 and state["draw"] == sum(m["train/draws"] for m in read_metrics(one) if "train/loss" in m)
    assert kat_train_grpo.main(grpo_args(assets, grpo_assets, two, *args, "--resume", "latest")) == 0
    assert rollouts_by_step(two)[3] == rollouts_by_step(one)[3]
    assert_same_update(load_backbone(two).model.state_dict(), want, init)


def test_a_draw_slower_than_a_step_keeps_its_weights_while_the_evaluation_runs(assets, grpo_assets, tmp_path,
                                                                                monkeypatch):
    """The thread's draws made slower than a step (a sleep before each decodes), no checkpoint between steps (a save
    waits for the draw in flight) and an evaluation every step running while a draw decodes: each draw's completions
    are what its engine's weights gave at the draw's start (the step waits for a draw before it copies new weights
    in), those are the starting weights for the first two draws and then moved, and no draw is started after the
    last step."""
    snapshots, draw = [], Rollouts.draw

    def refresh(self):  # the held engine's copy, as each draw starts from it
        copy = Engine.refresh.__wrapped__(self)
        if self.held:
            snapshots.append({k: v.clone() for k, v in copy.state_dict().items()})
        return copy

    refresh.__wrapped__ = Engine.refresh
    monkeypatch.setattr(Engine, "refresh", refresh)
    monkeypatch.setattr(Rollouts, "draw", lambda self, n, engine=None, quiet=False: (quiet and time.sleep(0.5), draw(
        self, n, engine, quiet))[1])
    out = tmp_path / "slow"
    argv = grpo_args(assets, grpo_assets, out, *COMMON, "--max_steps", "4", "--async_rollouts", "1", "--eval_every",
                     "1", "--temperature", "1.0")
    argv[argv.index("--val_ratio") + 1] = "0.2"
    assert kat_train_grpo.main(argv) == 0
    assert len(snapshots) == 4 and any("eval/" in k for m in read_metrics(out) for k in m)
    init = load_backbone(assets["gpt"]).state_dict()
    assert all(torch.equal(snapshots[k][name], init[name]) for k in (0, 1) for name in init)
    assert not all(torch.equal(snapshots[2][name], snapshots[1][name]) for name in init)
    tok = load_tokenizer_for(load_backbone(assets["gpt"]), str(assets["tokenizer"]))
    rows, _ = read_prompts(str(grpo_assets["prompts"]), None, 0.2)
    ids = encode_prompts(rows, Agent(AgentConfig(), tok).render_prompt, 512, 8, None)
    logged = rollouts_by_step(out)
    for step in (1, 2, 3, 4):
        model = load_backbone(assets["gpt"])
        model.load_state_dict(snapshots[step - 1])
        indices = sorted({i for i, _ in logged[step]})
        samples = Engine(model).generate([ids[i] for i in indices], 4, SamplingConfig(8, 1.0), tok.stop_ids,
                                         tok.pad_id, [torch.Generator().manual_seed(sample_seed(3, step - 1, i))
                                                      for i in indices])
        want = [(i, c) for k, i in enumerate(indices) for c in samples.completions[4 * k:4 * k + 4]]
        assert sorted(logged[step]) == sorted(want), step


def test_a_reward_that_raises_in_the_thread_ends_the_run_in_one_line_and_the_thread_with_it(assets, grpo_assets,
                                                                                            tmp_path, capsys):
    argv = grpo_args(assets, grpo_assets, tmp_path / "fails", *COMMON, "--max_steps", "3", "--async_rollouts", "1")
    argv[argv.index("rewards_for_tests:vowel_share")] = "rewards_for_tests:raises_runtime_error"
    assert kat_train_grpo.main(argv) == 2
    assert "reward function raises_runtime_error on prompt" in capsys.readouterr().err
    assert not [t for t in threading.enumerate() if t.name.startswith("rollouts")]
