"""Tool calls inside rollouts against nanochat's own Engine (tests/fixtures/nanochat-tool-use, made by nanochat
92d63d4): a checkpoint trained to call the calculator but to write a WRONG result itself, and the tokens and masks
nanochat's Engine produced from it, greedy. Ours, eager and compiled, must force the calculator's answer where
nanochat does, with the same tokens and masks."""
from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
import torch
from conftest import REPO, assert_same_update, run_script
from test_engine import aot_eager  # noqa: F401  (a fixture)
from torch._dynamo.utils import counters

from nanochat_ext.agent.agent import Agent, AgentConfig
from nanochat_ext.algorithms.evaluation import pass_at_k
from nanochat_ext.algorithms.grpo import LossConfig, policy_backward
from nanochat_ext.algorithms.rollout_batch import RolloutBatch
from nanochat_ext.data.conversations import load_conversations
from nanochat_ext.data.rows import load_prompts
from nanochat_ext.engine.engine import Engine
from nanochat_ext.engine.sampling import SamplingConfig
from nanochat_ext.errors import InputError
from nanochat_ext.models.loader import load_backbone, load_tokenizer_for
from nanochat_ext.tasks import synthetic
from nanochat_ext.tasks.reward_fns import contains_answer
from nanochat_ext.training.logprobs import CompletionLogprobs, make_sequences
from nanochat_ext.training.loop import LoopConfig
from scripts import kat_eval, kat_train_grpo

TOOL_USE = REPO / "tests" / "fixtures" / "nanochat-tool-use"
GOLDEN = torch.load(TOOL_USE / "golden.pt", weights_only=True)


@pytest.fixture(scope="module")
def policy():
    bb = load_backbone(TOOL_USE / "chatsft_checkpoints" / "d2")
    tok = load_tokenizer_for(bb, str(TOOL_USE / "tokenizer"))
    return bb, tok


def generate(engine: Engine, tok, prompts: list[list[int]], max_new: int, group: int = 2):
    gens = [torch.Generator().manual_seed(0) for _ in prompts]
    return engine.generate(prompts, group, SamplingConfig(max_new, 0.0), tok.stop_ids, tok.pad_id, gens)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_engine_forces_the_calculators_answer_as_nanochats_engine(policy, compiled, aot_eager):  # noqa: F811
    """All four prompts in one batch (ragged: left-padded to the longest), two samples each: every row's tokens and
    masks are nanochat's Engine's (its stream: the terminal <|assistant_end|> included): `3*4` forces 12 where the
    model would write 99, `1,200/4` forces 300.0, the refused `2**10` forces nothing, a string count forces 3."""
    bb, tok = policy
    torch._dynamo.reset()
    prompts = [p["prompt_tokens"] for p in GOLDEN["prompts"]]
    got = generate(Engine(bb, compile=compiled, agent=Agent(AgentConfig(), tok)), tok, prompts,
                   GOLDEN["engine_kwargs"]["max_tokens"])
    want = [row for p in GOLDEN["prompts"] for row in p["stream_tokens"]]
    want_masks = [row for p in GOLDEN["prompts"] for row in p["stream_masks"]]
    assert got.completions == want
    assert got.sampled == want_masks
    assert sum(m.count(0) for m in got.sampled) == 2 * (4 + 7 + 0 + 3)  # every forced token, none elsewhere
    if compiled:
        assert not counters["graph_break"], dict(counters["graph_break"])


def test_forced_tokens_count_towards_max_new_tokens(policy):
    """nanochat stops a row mid-answer when max_tokens runs out (golden `truncated`): so do we."""
    bb, tok = policy
    t = GOLDEN["truncated"]
    got = generate(Engine(bb, agent=Agent(AgentConfig(), tok)), tok, [GOLDEN["prompts"][0]["prompt_tokens"]],
                   t["kwargs"]["max_tokens"], group=1)
    assert got.completions == [t["completion_tokens"]] and got.sampled == [t["completion_masks"]]
    assert got.truncated == [True]


def test_without_tools_the_model_writes_its_own_results(policy):
    """--tools none: no block is answered and the model's own (wrong) results stand, as nanochat's own generate
    writes them; every token is sampled."""
    bb, tok = policy
    prompts = [p["prompt_tokens"] for p in GOLDEN["prompts"]]
    got = generate(Engine(bb), tok, prompts, GOLDEN["engine_kwargs"]["max_tokens"], group=1)
    assert got.sampled is None
    for completion, p in zip(got.completions, GOLDEN["prompts"]):
        assert completion == p["own_until_end"] + [tok.eos_id]


def test_no_gradient_flows_through_forced_tokens(policy):
    """A rollout's forced tokens are out of the GRPO loss: scoring a forced position against any other token
    leaves every gradient bitwise as it was; without the tools' mask (the defect) the gradient moves."""
    bb, tok = policy
    prompts = [p["prompt_tokens"] for p in GOLDEN["prompts"][:2]]
    completions = [p["stream_tokens"][0] for p in GOLDEN["prompts"][:2]]
    sampled = [p["stream_masks"][0] for p in GOLDEN["prompts"][:2]]
    forced = sampled[0].index(0)  # the first token the calculator forced into prompt 0's completion

    def grads(masks, target_at_forced: int | None) -> list[torch.Tensor]:
        batch = make_sequences(prompts, completions, 1, tok.pad_id, token_mask=masks)
        if target_at_forced is not None:
            batch.target[0, forced] = target_at_forced
        batch = RolloutBatch.of(batch, advantages=torch.tensor([1.0, -0.5]), weights=torch.ones(2))
        bb.zero_grad(set_to_none=True)
        policy_backward(CompletionLogprobs(bb), batch, 2, LossConfig(beta=0.0), torch.device("cpu"),
                        torch.autocast("cpu", enabled=False))
        return {n: p.grad.clone() for n, p in bb.model.named_parameters() if p.grad is not None}

    bb.set_trainable("all")
    other = (completions[0][forced] + 1) % bb.vocab_size
    masked = grads(sampled, None)
    assert all(torch.equal(a, b) for a, b in zip(masked.values(), grads(sampled, other).values()))
    assert not all(torch.equal(a, b) for a, b in zip(grads(None, None).values(), grads(None, other).values()))
    # At 2 layers nanochat's backout subtracts a multiple of the last block's own output, which the final norm scales
    # away: backout_lambda's gradient is rounding (the 2-rank test below leaves it out of its update comparison).
    assert masked["backout_lambda"].abs().item() < 1e-6 * masked["lm_head.weight"].norm().item()


def test_pass_at_k_is_nanochats_and_the_unbiased_estimator():
    """nanochat's pass@k (any of the first k correct) and Chen et al.'s estimator, against counting: the estimator
    is the share of all k-subsets of the n samples that hold a correct one."""
    correct = torch.tensor([[0, 1, 0, 0], [0, 0, 0, 0], [1, 1, 0, 1], [0, 0, 1, 0]], dtype=torch.bool)
    first, unbiased = pass_at_k(correct)
    rows = correct.tolist()
    assert first.tolist() == [sum(any(r[:k]) for r in rows) for k in range(1, 5)]
    want = [sum(sum(any(r[i] for i in subset) for subset in itertools.combinations(range(4), k)) /
                len(list(itertools.combinations(range(4), k))) for r in rows) for k in range(1, 5)]
    assert torch.allclose(unbiased, torch.tensor(want, dtype=torch.float64))


def grpo_with_tools(tmp_path, out, *extra) -> list[str]:
    prompts = tmp_path / "prompts.jsonl"
    answers = ["12", "300", "1024", "3"]
    prompts.write_text("".join(json.dumps({"prompt": p["conversation"]["messages"][0]["content"], "answer": a}) + "\n"
                               for p, a in zip(GOLDEN["prompts"], answers)))
    return ["--policy", str(TOOL_USE / "chatsft_checkpoints" / "d2"), "--tokenizer", str(TOOL_USE / "tokenizer"),
            "--prompts", str(prompts), "--reward_fn", "contains_answer", "--reward_fn", "rewards_for_tests:vowel_share",
            "--temperature", "2", "--batch_size", "4", "--group_size", "4",
            "--max_new_tokens", "40", "--beta", "0", "--lr", "1e-3", "--max_steps", "2", "--log_every", "1",
            "--eval_prompts", str(prompts), "--eval_pass_k", "4", "--log_rollouts", "--device", "cpu",
            "--out", str(out), *extra]


def rollouts(out) -> list[dict]:
    return [json.loads(line) for line in (out / "logs" / "rollouts.jsonl").read_text().splitlines()]


def test_grpo_with_tools_on_two_ranks_is_one_rank(tmp_path, policy):
    """GRPO from nanochat's tool-use checkpoint (tools on by default: its tokenizer has the python tokens): the
    calculator's answers are forced into the rollouts (12 for `3*4`, where the model would write 99) and logged
    with their masks; 2 ranks sample the same rollouts and take the same update as 1; --tools none forces nothing."""
    _, tok = policy
    one, two, off = tmp_path / "one", tmp_path / "two", tmp_path / "off"
    assert kat_train_grpo.main(grpo_with_tools(tmp_path, one)) == 0
    proc = run_script("scripts.kat_train_grpo", grpo_with_tools(tmp_path, two), nproc=2,
                      env={"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = rollouts(one)
    assert [(r["completion_ids"], r["sampled"]) for r in got] == [(r["completion_ids"], r["sampled"])
                                                                  for r in rollouts(two)]
    forced = [[t for t, m in zip(r["completion_ids"], r["sampled"]) if not m] for r in got]
    answer_12 = [tok.special("<|output_start|>"), *tok.encode("12"), tok.special("<|output_end|>")]
    assert answer_12 in forced and all(f == [] or f[0] == answer_12[0] for f in forced)
    metrics, metrics_two = ([json.loads(line) for line in (d / "logs" / "metrics.jsonl").read_text().splitlines()]
                            for d in (one, two))
    assert all(m["train/tool_calls"] > 0 for m in metrics if "train/tool_calls" in m)
    passes = [{k: v for k, v in m.items() if k.startswith("eval/pass@")} for m in (metrics[-1], metrics_two[-1])]
    assert passes[0] == passes[1] and len(passes[0]) == 8  # pass@1..4 and the unbiased estimates, over ranks
    curve = [passes[0][f"eval/pass@{j}"] for j in range(1, 5)]
    assert curve == sorted(curve) and curve[-1] == passes[0]["eval/pass@4_unbiased"] and 0 < curve[-1] <= 1
    # backout_lambda's gradient is rounding at 2 layers (test_no_gradient_flows_through_forced_tokens shows it), which
    # Adam turns into a step of lr with either sign: every other tensor is compared by its update.
    init, got, want = (load_backbone(d).model.state_dict() for d in (TOOL_USE / "chatsft_checkpoints" / "d2", two, one))
    assert_same_update(*({k: v for k, v in sd.items() if k != "backout_lambda"} for sd in (got, want, init)))
    assert kat_train_grpo.main(grpo_with_tools(tmp_path, off, "--tools", "none")) == 0
    assert all("sampled" not in r for r in rollouts(off))


def test_kat_eval_reports_pass_at_k(tmp_path, monkeypatch):
    """kat_eval --pass_k on nanochat's tool-use checkpoint: pass@1..K (and the unbiased estimates) in report.json
    and report.md."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(TOOL_USE))  # where nanochat keeps the tokenizer
    args = grpo_with_tools(tmp_path, tmp_path / "unused")
    prompts = args[args.index("--prompts") + 1]
    out = tmp_path / "report.md"
    assert kat_eval.main(["--base_dir", str(tmp_path), "--rm", "--policy_before", str(TOOL_USE / "chatsft_checkpoints"
                          / "d2"), "--eval_prompts", prompts, "--pass_k", "3", "--reward_fn", "contains_answer",
                          "--max_new_tokens", "40", "--samples", "2", "--out", str(out), "--device", "cpu"]) == 0
    policy = json.loads(out.with_suffix(".json").read_text())["policies"]["before (SFT)"]
    assert 0 < policy["pass@1"] <= policy["pass@3"] == policy["pass@3_unbiased"] <= 1
    # task accuracy without the demo's topics: the task reward's verdict on each greedy completion
    rows = load_prompts(prompts)
    assert [e["prompt"] for e in policy["examples"]] == [r.messages[-1]["content"] for r in rows]
    marks = [contains_answer(e["prompt"], e["completion"], r.row) for e, r in zip(policy["examples"], rows)]
    assert policy["task_accuracy_greedy"] == sum(marks) / len(marks) and policy["task_accuracy_sampled"] is not None
    assert "| pass@3 |" in out.read_text() and "| pass@3_unbiased |" in out.read_text()


def test_kat_eval_measures_tool_use_with_and_without_the_calculator(tmp_path, monkeypatch):
    """--tool_prompts: greedy task accuracy with the calculator and with --tools none on the same prompts (nanochat's
    tool-use model writes 99 itself: only the forced answers are right), calls per completion, refusals per call
    (`2**10` is refused), pass@k; in report.json and the report's "Tool use" table."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(TOOL_USE))
    args = grpo_with_tools(tmp_path, tmp_path / "unused")
    prompts = args[args.index("--prompts") + 1]
    out = tmp_path / "report.md"
    assert kat_eval.main(["--base_dir", str(tmp_path), "--rm", "--policy_before", str(TOOL_USE / "chatsft_checkpoints"
                          / "d2"), "--eval_prompts", prompts, "--tool_prompts", prompts, "--pass_k", "2",
                          "--reward_fn", "contains_answer", "--max_new_tokens", "8", "--samples", "1", "--out",
                          str(out), "--device", "cpu"]) == 0
    use = json.loads(out.with_suffix(".json").read_text())["policies"]["before (SFT)"]["tool_use"]
    assert use["accuracy_without_tools"] == 0 and use["accuracy_with_tools"] == 0.75  # 3*4, 1,200/4, strawberry
    assert use["tool_calls"] == 1 and use["tool_errors"] == 0.25 and 0 < use["pass@2"] <= 1
    assert "## Tool use on `prompts.jsonl`" in out.read_text() and "| accuracy_with_tools | 0.750 |" in out.read_text()


def test_the_demos_arithmetic_calls_the_calculator_in_nanochats_format(tmp_path):
    """The demo's arithmetic conversations render as nanochat's tool calls (the result masked out of SFT), and its
    judge reads the answer the model states after the tool block, not the one the tool forced."""
    tok = load_tokenizer_for(load_backbone(TOOL_USE / "chatsft_checkpoints" / "d2"), str(TOOL_USE / "tokenizer"))
    path = synthetic.write_jsonl(tmp_path / "sft.jsonl", synthetic.make_arithmetic_conversations(5, seed=1))
    for c in load_conversations(path):
        reply = c.turns[0]["content"]
        ids, mask = tok.render_reply(reply)
        assert [p["type"] for p in reply] == ["text", "python", "python_output", "text"]
        assert ids.count(tok.special("<|python_start|>")) == 1 \
            and mask.count(0) == len(tok.encode(reply[2]["text"])) + 2
    row = synthetic.make_arithmetic_prompts(1, seed=2)[0]
    forced = f"<|python_start|>x<|python_end|><|output_start|>{row['answer']}<|output_end|>"
    assert synthetic.judge("arithmetic", f"{forced} The answer is {row['answer']}.", row["answer"])
    assert not synthetic.judge("arithmetic", f"{forced} The answer is 1{row['answer']}.", row["answer"])


def nanochat_finds(checkpoints_dir: Path) -> Path:
    """The model file nanochat's load_model_from_dir(checkpoints_dir, ...) loads given no tag and no step, by its own
    rules (karpathy/nanochat 92d63d4, nanochat/checkpoint_manager.py): find_largest_model takes the d<N> tag with the
    largest N (else the newest dir), find_last_step the largest N of model_<N>.pt there, and load_checkpoint opens
    model_{N:06d}.pt and meta_{N:06d}.json."""
    tags = [d.name for d in checkpoints_dir.iterdir() if d.is_dir()]
    depths = sorted(((int(m.group(1)), t) for t in tags if (m := re.match(r"d(\d+)", t))), key=lambda x: -x[0])
    tag = depths[0][1] if depths else max(tags, key=lambda t: (checkpoints_dir / t).stat().st_mtime)
    d = checkpoints_dir / tag
    step = max(int(f.split("_")[-1].split(".")[0]) for f in (p.name for p in d.iterdir())
               if re.search(r"model_(\d+)\.pt$", f))
    assert (d / f"meta_{step:06d}.json").is_file()
    return d / f"model_{step:06d}.pt"


def test_preset_chat_rl_sets_nanochats_recipe_and_given_flags_override(tmp_path, capsys, monkeypatch):
    """--preset chat_rl: chat_rl's values, each printed at start; a flag given explicitly keeps its value (a given
    --reward_fn replaces the preset's, not adds to it); the run trains with them (Muon, linear decay to 0) for
    --num_epochs' steps (4 train prompts // 4 per step x 3), into $NANOCHAT_BASE_DIR/chatrl_checkpoints/d2 (the
    policy's depth) with every checkpoint kept, where nanochat's rules for load_model("rl") find our newest."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    args = grpo_with_tools(tmp_path, tmp_path / "unused", "--preset", "chat_rl", "--num_epochs", "3",
                           "--save_every", "1")
    for flag in ("--out", "--max_steps"):
        del args[args.index(flag):args.index(flag) + 2]
    parsed = kat_train_grpo.parse_args(args)
    assert (parsed.beta, parsed.num_iterations, parsed.scale_rewards, parsed.loss_agg, parsed.optimizer,
            parsed.lr, parsed.lr_decay, parsed.top_k, parsed.tools, parsed.eval_every) == \
        (0.0, 1, "none", "token", "muon", 1e-3, "linear", 50, "calculator", 60)  # --lr given: 1e-3
    assert (parsed.batch_size, parsed.group_size, parsed.max_new_tokens, parsed.eval_pass_k) == (4, 4, 40, 4)
    assert parsed.reward_fn == ["contains_answer", "rewards_for_tests:vowel_share"] and parsed.temperature == 2.0
    assert "group_size" not in parsed.preset_values and parsed.preset_values["top_k"] == 50
    alone = kat_train_grpo.parse_args(args[:2] + ["--prompts", "p", "--preset", "chat_rl"])
    assert alone.reward_fn == ["gsm8k"] and (alone.num_epochs, alone.max_steps, alone.keep_last) == (1, None, 0)
    smollm2 = kat_train_grpo.parse_args(args[:2] + ["--prompts", "p", "--preset", "word_arithmetic"])  # speedrun's
    assert (smollm2.reward_fn, smollm2.batch_size, smollm2.group_size, smollm2.max_new_tokens, smollm2.lr, smollm2.beta,
            smollm2.eval_every) == (["last_number"], 4, 8, 16, 3e-5, 0.0, 10)
    assert kat_train_grpo.main(args) == 0
    out = capsys.readouterr().out
    assert "preset chat_rl: --num_iterations 1 --scale_rewards none" in out and "--top_k 50" in out  # --beta given
    assert "max_steps: 3 = 4 train prompts // 4 per step x 3 epochs" in out
    logs = [json.loads(line) for line in (tmp_path / "base" / "chatrl_checkpoints" / "d2" / "logs" / "metrics.jsonl")
            .read_text().splitlines()]
    lrs = [r["train/lr"] for r in logs if "train/lr" in r]
    assert lrs == pytest.approx([lrs[0], lrs[0] * 2 / 3, lrs[0] / 3])  # linear to 0 over the 3 steps
    assert [r["step"] for r in logs if "eval/pass@1" in r] == [3]  # every 60 steps and at the end: at 3
    final = Path(re.findall(r"^checkpoint: (.*)$", out, re.M)[-1])
    assert final.parent == tmp_path / "base" / "chatrl_checkpoints" / "d2" \
        and len(list(final.parent.glob("model_*.pt"))) == 3
    assert nanochat_finds(tmp_path / "base" / "chatrl_checkpoints") == final
    meta = json.loads(final.with_name(final.name.replace("model_", "meta_").replace(".pt", ".json")).read_text())
    assert meta["step"] == 3 and "model_config" in meta


def test_num_epochs_sets_max_steps_from_the_data_unless_it_is_given(capsys):
    """chat_rl's count: len(train) // examples per step x epochs (467 on GSM8K's 7473 train rows at 16 per step); a
    --max_steps given wins; neither: 100. Too few prompts for one step is one line."""
    def steps(n_train: int, per_step: int, **kw) -> int:
        return LoopConfig(**{"max_steps": None, "num_epochs": None, **kw}).with_steps(n_train, per_step,
                                                                                       "prompts").max_steps

    assert steps(7473, 16, num_epochs=1) == 467
    assert "max_steps: 467 = 7473 train prompts // 16 per step x 1 epochs" in capsys.readouterr().out
    assert steps(7473, 16, num_epochs=2) == 934
    assert steps(7473, 16, num_epochs=1, max_steps=5) == 5
    assert "max_steps: 5 as given (--num_epochs 1 not used)" in capsys.readouterr().out
    assert steps(7473, 16) == 100 and steps(10, 16, max_steps=7) == 7
    with pytest.raises(InputError, match="--num_epochs 1: 3 train prompts make no step of 16"):
        steps(3, 16, num_epochs=1)


def test_kat_eval_pass_at_k_on_two_ranks_with_prompts_that_do_not_split_evenly(tmp_path, monkeypatch):
    """3 prompts on 2 ranks: every rank makes the same collective calls (no hang), and pass@k is one rank's."""
    args = grpo_with_tools(tmp_path, tmp_path / "unused")
    prompts = tmp_path / "three.jsonl"
    prompts.write_text("".join(Path(args[args.index("--prompts") + 1]).read_text().splitlines(keepends=True)[:3]))
    reports = []
    for nproc in (1, 2):
        out = tmp_path / f"report_{nproc}.md"
        argv = ["--base_dir", str(tmp_path), "--rm", "--policy_before", str(TOOL_USE / "chatsft_checkpoints" / "d2"),
                "--eval_prompts", str(prompts), "--pass_k", "2", "--reward_fn", "contains_answer", "--max_new_tokens",
                "40", "--samples", "1", "--out", str(out)]
        if nproc == 1:  # in this process: a launch costs more than the evaluation
            monkeypatch.setenv("NANOCHAT_BASE_DIR", str(TOOL_USE))
            assert kat_eval.main(argv) == 0
        else:
            proc = run_script("scripts.kat_eval", argv, nproc=nproc, env={"NANOCHAT_BASE_DIR": str(TOOL_USE)},
                              timeout=120)
            assert proc.returncode == 0, proc.stderr[-2000:]
        reports.append(json.loads(out.with_suffix(".json").read_text())["policies"]["before (SFT)"])
    assert {k: v for k, v in reports[0].items() if k.startswith("pass@")} == \
        {k: v for k, v in reports[1].items() if k.startswith("pass@")}
