"""The Python API (nanochat_ext.api, #66 item 4): a GRPO run from a notebook's objects (typed configs, a
datasets.Dataset, a reward function) is the script's run from files and flags, checkpoint and logs; options the
trainer does not have and rows without their field end as the script's do."""
from __future__ import annotations

import functools
import inspect
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import traceback

import numpy as np
import pytest
import torch
from conftest import REPO, assert_bitwise, assert_same_update, launcher, run_command
from datasets import Dataset
from rewards_for_tests import vowel_share

from nanochat_ext import api
from nanochat_ext.algorithms import answers
from nanochat_ext.algorithms.advantages import AdvantageInputs, Estimator, register_estimator, unregister_estimator
from nanochat_ext.algorithms.dpo import DPOConfig
from nanochat_ext.algorithms.grpo_config import GRPOConfig
from nanochat_ext.algorithms.rewards import Rewards, load_reward_fn
from nanochat_ext.algorithms.rollouts import RolloutConfig
from nanochat_ext.data.rows import PromptRow
from nanochat_ext.errors import EXIT_BAD_INPUT, InputError, RunFailed
from nanochat_ext.models.loader import load_backbone
from nanochat_ext.runtime.checkpoint import find_checkpoint, read_json
from nanochat_ext.tasks import synthetic
from nanochat_ext.tokenizer import TokenizerWrapper
from scripts import kat_train_grpo


def prompt_rows() -> list[dict]:
    return [{"prompt": r["prompt"], "answer": "Sure", "topic": r["topic"]} for r in synthetic.make_pairs(40, seed=5)]


def run_logs(out) -> list[dict]:
    """metrics.jsonl without what the clock decides (perf/*, timings)."""
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(("perf/", "time/"))}
            for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]


def test_grpo_in_python_is_the_scripts_run(assets, tmp_path):
    rows = prompt_rows()
    path = synthetic.write_jsonl(tmp_path / "prompts.jsonl", rows)
    common = {"policy": str(assets["gpt"]), "tokenizer": str(assets["tokenizer"]), "batch_size": 4, "lr": 1e-2,
              "max_steps": 3, "log_every": 1, "eval_every": 3, "device": "cpu", "log_rollouts": True}
    script = tmp_path / "script"
    assert kat_train_grpo.main(["--prompts", str(path), "--reward_fn", "rewards_for_tests:vowel_share",
                                "--group_size", "4", "--max_new_tokens", "8", "--beta", "0.05", "--out", str(script),
                                *[s for k, v in common.items() for s in (f"--{k}", *([] if v is True else [str(v)]))]]
                               ) == 0
    python = tmp_path / "python"
    checkpoint = api.train_grpo(RolloutConfig(group_size=4, max_new_tokens=8), GRPOConfig(beta=0.05),
                                prompts=Dataset.from_list(rows), reward_fn=[vowel_share], out=str(python), **common)
    model, meta = find_checkpoint(python)
    assert checkpoint == model
    assert_bitwise(load_backbone(python).model.state_dict(), load_backbone(script).model.state_dict())
    logs = run_logs(python)
    assert logs == run_logs(script) and any("train/reward_vowel_share" in m for m in logs)
    assert (python / "logs" / "rollouts.jsonl").read_text() == (script / "logs" / "rollouts.jsonl").read_text()
    # the run records the function as the script names it, and the rows by what they are
    flags, script_flags = read_json(meta)["args"], read_json(find_checkpoint(script)[1])["args"]
    assert flags["reward_fn"] == script_flags["reward_fn"] == ["rewards_for_tests:vowel_share"]
    assert flags["prompts"] == "prompts: a Dataset of 40 rows"


def test_a_call_leaves_the_processs_generators_as_they_were_and_repeats_bitwise_whatever_ran_before(assets, tmp_path):
    """#80 item 3: the generators a run seeds (Python's, NumPy's, torch's) are the caller's again after it, and the
    rendezvous variables (a one-process group takes a port); the same call after another trainer's call and the
    caller's own draws trains the same weights, bitwise (as each run seeds what it draws from)."""
    def grpo(out):
        return api.train_grpo(policy=str(assets["gpt"]), tokenizer=str(assets["tokenizer"]), prompts=prompt_rows(),
                              reward_fn=[vowel_share], batch_size=4, group_size=4, max_new_tokens=8, max_steps=2,
                              lr=1e-2, device="cpu", backend="gloo", out=str(tmp_path / out))  # (a group: a port)

    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state(), os.environ.get("MASTER_PORT"))
    first = grpo("first")
    after = (random.getstate(), np.random.get_state()[1], torch.get_rng_state(), os.environ.get("MASTER_PORT"))
    first = load_backbone(first.parent).model.state_dict()  # (a model's init draws from torch's generator)
    assert before[0] == after[0] and (before[1] == after[1]).all() and torch.equal(before[2], after[2]), \
        "a call left the caller's generators seeded by the run"
    assert before[3] == after[3]
    torch.rand(100), random.random(), np.random.rand(3)  # the caller draws; another trainer runs
    api.train_sft(backbone=str(assets["gpt"]), tokenizer=str(assets["tokenizer"]), max_steps=1, seed=11,
                  conversations=[{"messages": [{"role": "user", "content": f"hi {i}"},
                                               {"role": "assistant", "content": "hello"}]} for i in range(8)],
                  batch_size=4, device="cpu", out=str(tmp_path / "sft"))
    assert_bitwise(load_backbone(grpo("second").parent).model.state_dict(), first)


def test_generate_and_evaluate_answer_as_training_rendered_and_score_as_the_reward_does(assets, tmp_path):
    """#80 item 8: api.generate answers a trained checkpoint's prompts rendered as its run rendered rollouts (its chat
    template, the generation prompt, the tools its run recorded: none here), greedy equal to a token-by-token argmax
    of the model's own forward; sampled replies do not depend on the batch a prompt lands in; api.evaluate is the
    reward function's mean over generate's replies."""
    checkpoint = api.train_grpo(policy=str(assets["gpt"]), tokenizer=str(assets["tokenizer"]), prompts=prompt_rows(),
                                reward_fn=[vowel_share], batch_size=4, group_size=4, max_new_tokens=8, max_steps=1,
                                tools="none", device="cpu", out=str(tmp_path / "grpo"))
    flags = answers.recorded_flags(checkpoint)
    assert answers.recorded_tools(flags).tools == "none" and answers.recorded_flags(assets["gpt"]) == {}
    questions = ["Tell me about tea.", [{"role": "user", "content": "hi"}], {"prompt": "What is rain?", "answer": "w"}]
    kw = {"tokenizer": str(assets["tokenizer"]), "max_new_tokens": 6, "device": "cpu"}
    greedy = api.generate(checkpoint, questions, **kw)
    model, tok = load_backbone(checkpoint), TokenizerWrapper.load(assets["tokenizer"])
    for question, reply in zip(["Tell me about tea.", "hi", "What is rain?"], greedy):
        ids = tok.render_prompt([{"role": "user", "content": question}])  # no tools: the run had none
        out = []
        with torch.no_grad():
            while len(out) < 6 and (not out or out[-1] not in tok.stop_ids):
                out.append(int(model(torch.tensor([ids + out]))[0, -1].argmax()))
        assert reply == tok.reply_text(out), (question, reply, tok.reply_text(out))
    sampled = [api.generate(checkpoint, questions, n=2, temperature=1.0, seed=5, batch_size=b, **kw) for b in (1, 8)]
    assert sampled[0] == sampled[1] and all(len(r) == 2 for r in sampled[0])
    got = api.evaluate(checkpoint, questions, vowel_share, **kw)
    mean = sum(vowel_share("", r, {}) for r in greedy) / len(greedy)
    assert got == {"reward": pytest.approx(mean), "reward_vowel_share": pytest.approx(mean), "unscored": 0}
    assert api.generate(checkpoint, questions[:1], tokenizer=kw["tokenizer"], device="cpu") == \
        api.generate(checkpoint, questions[:1], max_new_tokens=8,
                     **{k: v for k, v in kw.items() if k != "max_new_tokens"})
    # a model no run of ours wrote (the demo's SFT model, a base model): 256 new tokens where its context has room,
    # else what the context leaves the longest prompt (a context of 256 here)
    kw_default = {k: v for k, v in kw.items() if k != "max_new_tokens"}
    room = 256 - len(tok.render_prompt([{"role": "user", "content": "Tell me about tea."}]))
    assert api.generate(assets["gpt"], questions[:1], **kw_default) == \
        api.generate(assets["gpt"], questions[:1], max_new_tokens=room, **kw_default)
    for call, said in [(lambda: api.generate(checkpoint, questions, n=0), "n 0 is out of range"),
                       (lambda: api.generate(checkpoint, questions, n=2), "n 2 at temperature 0 gives 2 equal replies"),
                       (lambda: api.generate(checkpoint, questions, max_new_token=4),
                        "generate has no option 'max_new_token'; did you mean max_new_tokens?"),
                       (lambda: api.generate(checkpoint, "What is rain?"),
                        "to ask one prompt, give a list: prompts=['What is rain?']"),
                       (lambda: api.generate(checkpoint, ["fine", ""]),
                        "prompts: a list of 2 rows[1]: field 'prompt': ")]:
        with pytest.raises(InputError) as e:
            call()
        assert said in str(e.value), (said, str(e.value))


def test_an_estimator_registered_from_outside_the_package_is_a_choice_and_computes_the_advantages(assets, tmp_path):
    """#81: a new estimator is a registration line (advantages.register_estimator) from your own code: --advantage
    takes it, its declarations check the flags (it reads no --scale_rewards: one given is refused in its line), and its
    compute gives the step's advantages: all zero here, so the loss has no gradient and the policy stays as it was."""
    seen = []

    def no_signal(x: AdvantageInputs) -> torch.Tensor:
        seen.append((x.group_size, tuple(x.rewards.shape)))
        return torch.zeros(x.rewards.shape, dtype=torch.float32)

    register_estimator("no_signal", Estimator(False, True, (), None, "this test's", no_signal))
    try:
        run = {"policy": str(assets["gpt"]), "tokenizer": str(assets["tokenizer"]), "prompts": prompt_rows(),
               "reward_fn": [vowel_share], "batch_size": 4, "group_size": 4, "max_new_tokens": 8, "max_steps": 2,
               "lr": 1e-2, "beta": 0.0, "log_every": 1, "device": "cpu"}
        with pytest.raises(RunFailed, match="--scale_rewards group: --advantage no_signal does not read it"):
            api.train_grpo(**run, advantage="no_signal", scale_rewards="group", out=str(tmp_path / "never"))
        checkpoint = api.train_grpo(**run, advantage="no_signal", out=str(tmp_path / "out"))
    finally:
        unregister_estimator("no_signal")
    with pytest.raises(InputError, match="--advantage rloo is a built-in estimator"):
        register_estimator("rloo", Estimator(False, True, (), None, "this test's", no_signal))
    assert seen == [(4, (16,))] * 2  # once a step, the step's 4 prompts x 4 completions
    assert [m["train/grad_norm"] for m in run_logs(tmp_path / "out") if "train/grad_norm" in m] == [0.0, 0.0]
    assert_bitwise(load_backbone(checkpoint).model.state_dict(), load_backbone(assets["gpt"]).model.state_dict())
    with pytest.raises(InputError, match="invalid choice: 'no_signal'"):  # unregistered: no longer a choice
        api.train_grpo(**run, advantage="no_signal", out=str(tmp_path / "never"))


def test_generate_on_a_hugging_face_model_is_transformers_own_greedy_generate_on_ragged_prompts(assets):
    """api.generate on a Hugging Face model (its chat template, prompts of different lengths decoded in one left-padded
    batch by our native Llama) gives what transformers' own generate gives for each prompt alone, greedy, stopping at
    the tokenizer's stop tokens: the oracle is transformers', not this project's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415  (the oracle, loaded here only)

    questions = ["hi", "Tell me something about the weather in the mountains today, please.", "What is tea?"]
    got = api.generate(str(assets["hf"]), questions, max_new_tokens=6, device="cpu", tools="none", batch_size=8)
    hf_tok, model = AutoTokenizer.from_pretrained(assets["hf"]), AutoModelForCausalLM.from_pretrained(assets["hf"])
    ours = TokenizerWrapper.load(assets["hf"], model_dir=assets["hf"])
    want = []
    for q in questions:
        ids = hf_tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]
        out = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=list(ours.stop_ids),
                             pad_token_id=hf_tok.pad_token_id)
        want.append(ours.reply_text(out[0, ids.shape[1]:].tolist()))
    assert got == want, (got, want)


def test_a_script_of_your_own_under_torchrun_is_the_one_rank_run(assets, tmp_path):
    """The docs' "More than one GPU": a user's file calling the API, started on 2 ranks, every rank making the same call
    with a reward function defined in that file (__main__); the update is the 1-rank script's."""
    rows = prompt_rows()
    path = synthetic.write_jsonl(tmp_path / "prompts.jsonl", rows)
    common = ["--policy", str(assets["gpt"]), "--tokenizer", str(assets["tokenizer"]), "--batch_size", "4",
              "--group_size", "4", "--max_new_tokens", "8", "--lr", "1e-2", "--max_steps", "2", "--device", "cpu"]
    one = tmp_path / "one"
    assert kat_train_grpo.main([*common, "--prompts", str(path), "--reward_fn", "rewards_for_tests:vowel_share",
                                "--out", str(one)]) == 0
    mine = tmp_path / "my_training.py"
    mine.write_text(textwrap.dedent(f"""
        import json
        from nanochat_ext import api

        {textwrap.indent(inspect.getsource(vowel_share), "        ").strip()}

        rows = [json.loads(line) for line in open({str(path)!r})]
        print("returned", api.train_grpo(policy={str(assets["gpt"])!r}, tokenizer={str(assets["tokenizer"])!r},
                                         prompts=rows, reward_fn=[vowel_share], batch_size=4, group_size=4,
                                         max_new_tokens=8, lr=1e-2, max_steps=2, device="cpu",
                                         out={str(tmp_path / "two")!r}))
        """))
    proc = run_command([str(mine)], 2, None, tmp_path, 300, launcher(2))
    assert proc.returncode == 0, proc.stderr[-3000:]
    model, meta = find_checkpoint(tmp_path / "two")
    assert proc.stdout.count(f"returned {model}") == 2  # every rank's call returns the checkpoint
    assert read_json(meta)["args"]["reward_fn"] == ["__main__:vowel_share"]
    assert_same_update(load_backbone(tmp_path / "two").model.state_dict(), load_backbone(one).model.state_dict(),
                       load_backbone(assets["gpt"]).model.state_dict())


def test_what_the_trainer_does_not_take_is_refused_before_anything_runs(assets, tmp_path, capfd):
    needs = {"policy": str(assets["gpt"]), "prompts": prompt_rows(), "reward_fn": [vowel_share], "device": "cpu",
             "out": str(tmp_path / "never")}
    for call, said in [(lambda: api.train_grpo(**needs, grup_size=4), "kat_train_grpo has no option 'grup_size'"),
                       (lambda: api.train_grpo(DPOConfig(beta=0.5), **needs),
                        "DPOConfig is not a config of kat_train_grpo (its configs: RewardConfig, RolloutConfig"),
                       (lambda: api.train_grpo("--beta", **needs), "kat_train_grpo takes configs"),
                       (lambda: api.train_grpo(**needs, loss_agg="mean"), "invalid choice: 'mean'"),
                       (lambda: api.train_dpo(policy=str(assets["gpt"])),
                        "kat_train_dpo: the following arguments are required: --pairs"),
                       (lambda: api.train_grpo(**needs, log_rollouts="false"),
                        "kat_train_grpo's option log_rollouts is True or False, got 'false'"),
                       (lambda: api.train_grpo(**needs, reward_weights=1.0),
                        "kat_train_grpo's option reward_weights takes a list, got 1.0"),
                       (lambda: api.train_grpo(**needs, reward_weights=[]),
                        "kat_train_grpo: argument --reward_weights: expected at least one value, got []")]:
        with pytest.raises(InputError) as e:
            call()
        assert said in str(e.value), (said, str(e.value))
    # a value in its flag's type but out of its range: the run's own check, its line, the script's exit code
    with pytest.raises(RunFailed) as e:
        api.train_grpo(**needs, group_size=1)
    assert e.value.code == EXIT_BAD_INPUT and "error: --group_size must be >= 2" in capfd.readouterr().err
    # two functions of one name (a partial is named by its function) would log as one reward
    with pytest.raises(RunFailed):
        api.train_grpo(**{**needs, "reward_fn": [vowel_share, functools.partial(vowel_share)]})
    assert "two rewards are named vowel_share" in capfd.readouterr().err
    assert not (tmp_path / "never").exists()


def test_a_row_without_its_field_ends_as_the_script_does(assets, tmp_path, capfd):
    rows = prompt_rows()[:3] + [{"question_text": "where is the prompt?"}]
    with pytest.raises(RunFailed) as e:
        api.train_grpo(policy=str(assets["gpt"]), prompts=rows, reward_fn=vowel_share, out=str(tmp_path / "never"),
                       device="cpu")
    assert e.value.code == EXIT_BAD_INPUT
    assert "error: prompts: a list of 4 rows[3]: field 'prompt': missing" in capfd.readouterr().err
    assert not (tmp_path / "never").exists()
    with pytest.raises(RunFailed):
        api.train_grpo(policy=str(assets["gpt"]), prompts=[*rows[:3], 42], reward_fn=vowel_share,
                       out=str(tmp_path / "never"), device="cpu")
    assert "prompts: a list of 4 rows[3]: expected a dict, got int" in capfd.readouterr().err  # (a string is a prompt)


@pytest.mark.parametrize("train,model,data", [(api.train_sft, "backbone", "conversations"),
                                              (api.train_rm, "backbone", "pairs"),
                                              (api.train_dpo, "policy", "pairs")])
def test_every_trainer_reads_rows_given_in_python(assets, tmp_path, capfd, train, model, data):
    """Each trainer's data option takes rows: a bad one is named by its index, as a file's by its line."""
    pair = {"prompt": "hi", "chosen": "hello", "rejected": "go away"}
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]} \
        if data == "conversations" else pair
    with pytest.raises(RunFailed) as e:
        train(**{model: str(assets["gpt"]), data: [good, {"nothing": 1}]}, out=str(tmp_path / "never"), device="cpu")
    assert e.value.code == EXIT_BAD_INPUT
    assert f"error: {data}: a list of 2 rows[1]: " in capfd.readouterr().err
    assert not (tmp_path / "never").exists()


def test_calls_one_after_another_under_torchrun_each_make_and_end_their_group(assets, tmp_path):
    """#80 item 1: the documented pipeline as one user's script on 2 ranks under torchrun (its agent's store, as users
    launch it): SFT, a reward model, DPO, then GRPO on the DPO checkpoint, one call after another in one process; each
    call makes and ends its own process group (torch names every default group alike: each gets keys of its own, or
    the second call hung); the caller's SIGTERM handler is its own after every call. A GRPO call with
    --async_rollouts 1 (its thread's collectives on a group of its own) comes before the last: it leaves no thread
    and no group behind that the next call trips on."""
    rows = prompt_rows()
    prompts = synthetic.write_jsonl(tmp_path / "prompts.jsonl", rows)
    tiny = {"tokenizer": str(assets["tokenizer"]), "device": "cpu", "max_steps": 1}
    mine = tmp_path / "pipeline.py"
    mine.write_text(textwrap.dedent(f"""
        import json, os, signal, threading
        from nanochat_ext import api

        def mine(*_):
            pass

        signal.signal(signal.SIGTERM, mine)
        pairs = [json.loads(line) for line in open({str(assets["pairs"])!r})][:64]
        talks = [{{"messages": [{{"role": "user", "content": p["prompt"]}},
                                {{"role": "assistant", "content": p["chosen"]}}]}} for p in pairs]
        prompts = [json.loads(line) for line in open({str(prompts)!r})]
        tiny = {tiny!r}
        sft = api.train_sft(backbone={str(assets["gpt"])!r}, conversations=talks, batch_size=4,
                            out={str(tmp_path / "sft")!r}, **tiny)
        rm = api.train_rm(backbone={str(assets["gpt"])!r}, pairs=pairs, batch_size=4, out={str(tmp_path / "rm")!r},
                          **tiny)
        dpo = api.train_dpo(policy=str(sft), pairs=pairs, batch_size=4, out={str(tmp_path / "dpo")!r}, **tiny)
        ahead = api.train_grpo(policy=str(dpo), prompts=prompts, rm=str(rm), batch_size=4, group_size=4,
                               max_new_tokens=8, async_rollouts=1, out={str(tmp_path / "ahead")!r},
                               **{{**tiny, "max_steps": 2}})
        assert not [t for t in threading.enumerate() if t.name.startswith("rollouts")]
        grpo = api.train_grpo(policy=str(dpo), prompts=prompts, rm=str(rm), batch_size=4, group_size=4,
                              max_new_tokens=8, out={str(tmp_path / "grpo")!r}, **tiny)
        assert signal.getsignal(signal.SIGTERM) is mine
        with open(f"{tmp_path}/rank_{{os.environ['RANK']}}.txt", "w") as f:  # the ranks share one stdout pipe
            f.write(" ".join(["pipeline", sft.parent.name, rm.parent.name, dpo.parent.name, ahead.parent.name,
                              grpo.parent.name]))
        """))
    proc = run_command([str(mine)], 2, None, tmp_path, 300, launcher(2, torchrun=True))
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [(tmp_path / f"rank_{r}.txt").read_text() for r in range(2)]  # every rank's calls all returned
    assert said == ["pipeline sft rm dpo ahead grpo"] * 2, (said, proc.stdout[-2000:])


def test_the_callers_signal_handlers_are_its_own_after_every_call_and_a_thread_may_call(assets, tmp_path):
    """#80 item 2: after a call that succeeds, one refused before it runs and one that fails inside, the caller's
    SIGTERM and SIGINT handlers are the same objects; a call from a thread other than the main one runs (it installs
    no handlers: a preemption is then its caller's) and fails, where it fails, as a call from the main thread does."""
    rows = prompt_rows()
    grpo = {"policy": str(assets["gpt"]), "tokenizer": str(assets["tokenizer"]), "prompts": rows,
            "reward_fn": [vowel_share], "batch_size": 4, "group_size": 4, "max_new_tokens": 8, "max_steps": 1,
            "device": "cpu"}
    before = signal.signal(signal.SIGTERM, lambda *_: None), signal.getsignal(signal.SIGTERM), \
        signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(InputError):
            api.train_grpo(**grpo, no_such_option=1)
        with pytest.raises(RunFailed):
            api.train_dpo(policy=str(assets["gpt"]), pairs=[{"nothing": 1}], out=str(tmp_path / "never"), device="cpu")
        assert api.train_grpo(**grpo, out=str(tmp_path / "main")).is_file()
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before[1:]
    finally:
        signal.signal(signal.SIGTERM, before[0])
    got = {}

    def call(name, **options):
        try:
            got[name] = api.train_grpo(**{**grpo, **options}, out=str(tmp_path / name))
        except BaseException as e:  # what the thread's caller would see
            got[name] = e

    for name, options in (("thread", {}), ("bad_row", {"prompts": [{"nothing": 1}]})):
        thread = threading.Thread(target=call, args=(name,), kwargs=options)
        thread.start()
        thread.join(120)
    assert got["thread"].is_file(), got
    assert isinstance(got["bad_row"], RunFailed) and got["bad_row"].code == EXIT_BAD_INPUT, got


def test_a_users_exception_keeps_its_traceback_in_the_chain(assets, tmp_path):
    """#80 item 3: a reward function of the user's that raises ends the call in RunFailed whose message is the run's
    one line, raised from the error that ended the run, itself from the user's exception: the chain shows the line
    of the user's own function that failed."""
    def my_reward(prompt, completion, row):
        return float(row["no_such_field"])  # the user's mistake

    with pytest.raises(RunFailed) as e:
        api.train_grpo(policy=str(assets["gpt"]), tokenizer=str(assets["tokenizer"]), prompts=prompt_rows(),
                       reward_fn=[my_reward], batch_size=4, group_size=4, max_new_tokens=8, max_steps=1,
                       device="cpu", out=str(tmp_path / "out"))
    assert e.value.code == EXIT_BAD_INPUT and "my_reward" in str(e.value) and "KeyError" in str(e.value), e.value
    chain = "".join(traceback.format_exception(e.value))
    assert 'return float(row["no_such_field"])  # the user\'s mistake' in chain, chain[-2000:]
    # the row as the user numbers it (an index into the rows given), and the traceback kept in the run's logs
    assert re.search(r"my_reward on prompt prompts: a list of 40 rows\[\d+\] raised KeyError", str(e.value)), e.value
    kept = tmp_path / "out" / "logs" / "traceback_rank0.txt"
    assert str(e.value).endswith(f"(its traceback: {kept})") and "# the user's mistake" in kept.read_text()


def test_a_reward_function_in_trls_form_is_named_before_the_model_loads_and_trl_reward_passes_it(tmp_path):
    """#80 item 8: TRL's reward functions take (completions, **columns) and return a list: given as one here, the call
    ends before the policy loads (the policy is not a checkpoint: loading it first would say so) in a line that names
    TRL's form and api.trl_reward; a misspelt built-in lists the built-ins."""
    def trl_reward(completions, **kwargs):
        return [float(len(c)) for c in completions]

    not_a_checkpoint = tmp_path / "notes.txt"
    not_a_checkpoint.write_text("not a model\n")
    needs = {"policy": str(not_a_checkpoint), "prompts": prompt_rows(), "device": "cpu", "out": str(tmp_path / "out")}
    for reward, said in [(trl_reward, "takes (completions, **kwargs), as TRL's reward functions do; a reward function "
                                      "here is f(prompt, completion, row) -> float"),
                         ("gsm8kk", "--reward_fn 'gsm8kk' is not a built-in reward (did you mean gsm8k?); the "
                                    "built-ins: exact_match, contains_answer,")]:
        with pytest.raises(RunFailed) as e:
            api.train_grpo(**needs, reward_fn=reward)
        assert e.value.code == EXIT_BAD_INPUT and said in str(e.value), e.value
    assert not (tmp_path / "out").exists()
    with pytest.raises(InputError, match=re.escape("; pass a TRL reward function as nanochat_ext.api.trl_reward(f)")):
        load_reward_fn(trl_reward)
    assert load_reward_fn(api.trl_reward(trl_reward)).batched  # passed as TRL's: called with the step's lists


def test_trl_reward_gives_a_trl_function_the_prompts_completions_and_columns_as_trl_does():
    """api.trl_reward(f): f is called as TRL's GRPOTrainer calls it (prompts=, completions=, and each other column of
    the rows as a keyword list), and scores each completion as the same rule written in this project's form."""
    seen = {}

    def matches_answer(prompts, completions, answer, **kwargs):
        seen.update(prompts=prompts, kwargs=kwargs)
        return [float(c.strip() == str(a)) for c, a in zip(completions, answer)]

    def plain(prompt, completion, row):
        return float(completion.strip() == str(row["answer"]))

    rows = [PromptRow([{"role": "user", "content": f"q{i}"}], str(i), {"prompt": f"q{i}", "answer": i, "topic": "t"},
                      i + 1, path="p.jsonl") for i in range(3)]
    texts = ["0", " 5", "2 "]
    got = Rewards(None, [api.trl_reward(matches_answer)], None).task_scores(rows, [0, 1, 2], texts)
    assert got == Rewards(None, [plain], None).task_scores(rows, [0, 1, 2], texts) == [1.0, 0.0, 1.0]
    assert seen == {"prompts": ["q0", "q1", "q2"], "kwargs": {"topic": ["t", "t", "t"]}}
    assert Rewards(None, [api.trl_reward(matches_answer)], None).names == ["matches_answer"]

    def conversational(prompts, completions, **kwargs):  # TRL's conversational form: completion[0]["content"]
        seen.update(prompts=prompts)
        return [float(c[0]["content"].strip() == "0") for c in completions]

    chat = [PromptRow(r.messages, r.prefix_id, {**r.row, "prompt": r.messages}, r.line) for r in rows]
    assert Rewards(None, [api.trl_reward(conversational)], None).task_scores(chat, [0, 1], texts[:2]) == [1.0, 0.0]
    assert seen["prompts"] == [[{"role": "user", "content": "q0"}], [{"role": "user", "content": "q1"}]]


@pytest.mark.parametrize("option,said", [("num_generations", ": TRL's num_generations is group_size here"),
                                         ("learning_rate", ": TRL's learning_rate is lr here"),
                                         ("max_step", "; did you mean max_steps?")])
def test_an_option_a_trl_user_would_write_is_named_in_our_words(option, said):
    """#80 item 8: TRL's names and typos are refused before anything runs, saying what the option is called here."""
    with pytest.raises(InputError, match=re.escape(f"kat_train_grpo has no option {option!r}{said}")):
        api.train_grpo(policy="never-loaded", **{option: 1})


def test_the_package_installs_and_trains_from_outside_the_repository(assets, tmp_path):
    """#80 item 8: a plain `pip install` of the clone (its build-system: setuptools; its dependencies: the pins of
    requirements.txt) puts the package, the sandbox's files included, where a script outside the repository imports it,
    and the Python quick start's call trains there (the dependencies are this environment's: nothing is downloaded)."""
    source, site, elsewhere = tmp_path / "clone", tmp_path / "site", tmp_path / "elsewhere"
    shutil.copytree(REPO / "nanochat_ext", source / "nanochat_ext", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "requirements.txt", "README.md", "LICENSE"):
        shutil.copy(REPO / name, source / name)
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--target", str(site), str(source)], capture_output=True, text=True, cwd=tmp_path)
    assert pip.returncode == 0, pip.stderr[-2000:]
    meta = next(site.glob("nanochat_ext-*.dist-info")) / "METADATA"
    assert "Requires-Dist: torch==2.13.0" in meta.read_text()
    elsewhere.mkdir()
    (elsewhere / "train.py").write_text(textwrap.dedent(f"""
        from nanochat_ext import api

        def reward(prompt, completion, row):
            return float(len(completion) % 3 == 0)

        prompts = [{{"prompt": f"What is {{a}} times 7?", "answer": a * 7}} for a in range(8)]
        print(api.__file__)
        print(api.train_grpo(policy={str(assets["gpt"])!r}, tokenizer={str(assets["tokenizer"])!r}, prompts=prompts,
                             reward_fn=[reward], batch_size=4, group_size=4, max_new_tokens=8, max_steps=1,
                             device="cpu", out="runs/grpo"))
        """))
    run = subprocess.run([sys.executable, "train.py"], capture_output=True, text=True, cwd=elsewhere, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(site)})
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    installed, checkpoint = lines[0], lines[-1]  # api's file, before the run's lines; what the call returned
    assert installed.startswith(str(site)) and (elsewhere / checkpoint).is_file(), run.stdout[-1000:]
    # the trainers' command lines as console commands (one run: each is its recipe's main, as the scripts')
    entry_points = (meta.parent / "entry_points.txt").read_text()
    assert all(f"{c} = nanochat_ext.recipes.{m}:main" in entry_points for c, m in [
        ("kat-sft", "sft"), ("kat-train-rm", "rm"), ("kat-train-dpo", "dpo"), ("kat-train-grpo", "grpo")]), entry_points
    helped = subprocess.run([str(site / "bin" / "kat-train-grpo"), "--help"], capture_output=True, text=True,
                            cwd=elsewhere, env={**os.environ, "PYTHONPATH": str(site)}, timeout=120)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: kat_train_grpo "), helped.stderr[-1000:]
