"""On-policy distillation (--advantage distill, #68 item 1): the policy samples, a frozen teacher of another
architecture scores each sampled token, and the reverse KL to it falls as the policy trains, with no reward; 2 ranks
take the 1-rank update, a resumed run the uninterrupted one's (and only from its own teacher); a teacher of another
vocabulary, or distillation without one, ends in one line. Its advantages against the Tinker cookbook's own code:
test_trl_oracle.py."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import REPO, assert_bitwise, assert_same_update, assert_stopped, run_script
from test_grpo import grpo_args, read_metrics

from nanochat_ext.models.loader import load_backbone, load_tokenizer_for
from nanochat_ext.tasks import synthetic
from nanochat_ext.tokenizer import PROBE, TokenizerWrapper, same_ids
from scripts import kat_train_grpo

DISTILL = ("--advantage", "distill", "--batch_size", "4", "--group_size", "4", "--log_every", "1")


@pytest.fixture(scope="module")
def prompts(assets, tmp_path_factory):
    """The prompts, and a teacher with an opinion the policy can learn in a few steps: nanochat's current GPT (another
    architecture than the policy's oct2025 one) after 30 GRPO steps towards vowels."""
    d = tmp_path_factory.mktemp("distill")
    rows = synthetic.make_pairs(40, seed=3)
    made = {"prompts": synthetic.write_jsonl(d / "prompts.jsonl", [{"prompt": r["prompt"]} for r in rows]),
            "teacher": d / "teacher"}
    args = grpo_args(assets, made, made["teacher"], "--reward_fn", "rewards_for_tests:vowel_share", "--beta", "0",
                     "--batch_size", "4", "--group_size", "4", "--max_steps", "30")
    args[1] = str(assets["gpt_modern"])
    assert kat_train_grpo.main(args) == 0
    return made


def next_token_reverse_kl(student_dir, teacher_dir, tokenizer, prompts_path) -> float:
    """KL(student || teacher) over the whole vocabulary of the next token after each prompt (in the chat template, as
    rollouts start), mean over the prompts: what the sampled per-token reverse KL estimates, with no sampling in it."""
    student, teacher = load_backbone(student_dir).eval(), load_backbone(teacher_dir).eval()
    tok = load_tokenizer_for(student, str(tokenizer))
    rows = [json.loads(line) for line in prompts_path.read_text().splitlines()]
    kl = []
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([tok.render_prompt([{"role": "user", "content": row["prompt"]}])])
            s, t = (torch.log_softmax(m(ids)[0, -1].double(), -1) for m in (student, teacher))
            kl.append(float((s.exp() * (s - t)).sum()))
    return sum(kl) / len(kl)


def test_the_reverse_kl_to_the_teacher_falls_without_a_reward(assets, prompts, tmp_path):
    out = tmp_path / "student"
    assert kat_train_grpo.main(grpo_args(assets, prompts, out, *DISTILL, "--teacher", str(prompts["teacher"]),
                                         "--max_steps", "16")) == 0
    logged = [m for m in read_metrics(out) if "train/teacher_kl" in m]
    assert len(logged) == 16 and not any("train/reward" in m for m in logged)
    assert not any(k.startswith("eval/") for m in read_metrics(out) for k in m)  # no reward scores held-out prompts
    # the policy moves towards the teacher: the exact reverse KL at the prompts' first token, before and after
    before, after = (next_token_reverse_kl(student, prompts["teacher"], assets["tokenizer"], prompts["prompts"])
                     for student in (assets["gpt"], out))
    assert after < 0.7 * before, (before, after)


def test_two_ranks_distill_as_one(assets, prompts, tmp_path):
    args = lambda out: grpo_args(assets, prompts, out, *DISTILL, "--teacher", str(prompts["teacher"]),  # noqa: E731
                                 "--max_steps", "2")
    assert kat_train_grpo.main(args(tmp_path / "one")) == 0
    proc = run_script("scripts.kat_train_grpo", args(tmp_path / "two"), nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_update(load_backbone(tmp_path / "two").model.state_dict(),
                       load_backbone(tmp_path / "one").model.state_dict(),
                       load_backbone(assets["gpt"]).model.state_dict())


@pytest.mark.parametrize("flags,line", [
    (("--teacher", "{small}"), "the teacher's vocabulary has 300 ids, the policy's tokenizer 512"),
    ((), "--advantage distill needs a --teacher"),
])
def test_distillation_without_a_teacher_that_fits_ends_in_one_line(assets, prompts, tmp_path, flags, line):
    flags = [f.format(small=assets["gpt_small_vocab"]) for f in flags]
    proc = run_script("scripts.kat_train_grpo", grpo_args(assets, prompts, tmp_path / "never", *DISTILL, *flags,
                                                          "--max_steps", "1"))
    assert_stopped(proc, 2, line)
    assert not (tmp_path / "never").exists()


def test_a_distillation_resumes_exactly_and_only_from_its_teacher(assets, prompts, tmp_path):
    common = (*DISTILL, "--teacher", str(prompts["teacher"]), "--max_steps", "4")
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    assert kat_train_grpo.main(grpo_args(assets, prompts, straight, *common)) == 0
    assert kat_train_grpo.main(grpo_args(assets, prompts, crashed, *common, "--save_every", "2")) == 0
    last = sorted(int(p.stem.split("_")[1]) for p in crashed.glob("model_*.pt"))[-1]
    for name in (f"model_{last}.pt", f"meta_{last}.json", f"state_{last}.pt"):
        (crashed / name).unlink()
    other = grpo_args(assets, prompts, crashed, *common, "--resume", "latest")
    other[other.index("--teacher") + 1] = str(assets["gpt_modern"])
    assert kat_train_grpo.main(other) == 2  # another teacher: refused, naming the flag
    assert kat_train_grpo.main(grpo_args(assets, prompts, crashed, *common, "--resume", "latest")) == 0
    assert_bitwise(load_backbone(crashed).model.state_dict(), load_backbone(straight).model.state_dict())


def test_a_teacher_or_rm_tokenizer_is_compared_by_the_conversation_it_renders(tmp_path):
    """#80 item 6: two tokenizers of one vocabulary whose chat templates write the turns with other special tokens
    give the policy's ids other meanings: not the same ids (a teacher or an RM scoring them is refused), though their
    size, a probe's ids and the end id agree; a copy of the same tokenizer is the same."""
    fixture = REPO / "tests" / "fixtures" / "hf-tool-use"
    same, other = tmp_path / "same", tmp_path / "other"
    shutil.copytree(fixture, same)
    shutil.copytree(fixture, other)
    template = (other / "chat_template.jinja").read_text()
    assert "<|im_start|>" in template
    (other / "chat_template.jinja").write_text(template.replace("<|im_start|>", "<|im_end|>"))
    policy = TokenizerWrapper.load(fixture)
    assert same_ids(policy, TokenizerWrapper.load(same))
    changed = TokenizerWrapper.load(other)
    assert (changed.vocab_size, changed.encode(PROBE), changed.eos_id) == (policy.vocab_size, policy.encode(PROBE),
                                                                          policy.eos_id)
    assert not same_ids(policy, changed)
