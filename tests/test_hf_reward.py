"""Reward models as transformers sequence classifiers: ours exported load in transformers with our scores, and
classifiers transformers wrote score here as transformers scores them (the Llama family natively, others through
transformers), as --rm in GRPO too."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from nanochat_ext.models.loader import load_backbone, load_tokenizer_for
from nanochat_ext.models.reward_model import load_reward_model
from nanochat_ext.tasks import synthetic
from scripts import kat_export_rm, kat_train_grpo, kat_train_rm

# Ragged: prompts of different lengths, one sequence ending in the tokenizer's EOS, one a single token.
SEQS = [[5, 17, 42, 99, 7], [3, 250], [11, 12, 13, 14, 15, 16, 17, 18, 19], [77]]


def transformers_scores(model_dir, seqs: list[list[int]], pad_id: int) -> list[float]:
    """transformers' own scores: AutoModelForSequenceClassification on a right-padded batch with its mask."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    width = max(map(len, seqs))
    ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits[:, 0].tolist()


@pytest.fixture(scope="module", params=["last_block", "lora"])
def hf_rm(assets, tmp_path_factory, request):
    """An RM trained here on the tiny Hugging Face Llama: its last block and head, or LoRA adapters (peft, on our
    Llama's fused projections: the export merges them) and the head."""
    out = tmp_path_factory.mktemp("hf_rm") / "rm"
    trains = ["--unfreeze_last", "1"] if request.param == "last_block" else ["--lora_r", "4", "--lr", "2e-2"]
    assert kat_train_rm.main(["--backbone", str(assets["hf"]), "--pairs", str(assets["pairs"]), "--max_steps", "3",
                              "--batch_size", "8", "--max_len", "64", "--device", "cpu", "--out", str(out),
                              *trains]) == 0
    return out


def test_an_exported_rm_loads_in_transformers_with_our_scores(hf_rm, tmp_path):
    ours = load_reward_model(hf_rm)
    eos = ours.tokenizer.eos_id
    seqs = SEQS + [[5, 17, 42, eos]]
    out = tmp_path / "exported"
    assert kat_export_rm.main(["--rm", str(hf_rm), "--out", str(out), "--format", "hf"]) == 0
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    want = ours.score_ids(seqs)
    got = transformers_scores(out, seqs, ours.tokenizer.pad_id)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)
    again = load_reward_model(out)  # and as --rm here: the same scores, grouped or not
    torch.testing.assert_close(torch.tensor(again.score_ids(seqs)), torch.tensor(want), atol=1e-5, rtol=0)
    group = [[5, 17, 42, 9, 9], [5, 17, 42, 8], [3, 4, 6], [3, 4, 7, 7, 7]]  # pairs sharing a prompt; no pad id
    torch.testing.assert_close(torch.tensor(again.score_ids(group, group=2)), torch.tensor(ours.score_ids(group)),
                               atol=1e-5, rtol=0)


def test_a_nanochat_rm_keeps_its_format(assets, tmp_path, capsys):
    rm = tmp_path / "rm"
    assert kat_train_rm.main(["--backbone", str(assets["gpt"]), "--pairs", str(assets["pairs"]), "--max_steps", "1",
                              "--batch_size", "8", "--max_len", "64", "--device", "cpu", "--out", str(rm)]) == 0
    assert kat_export_rm.main(["--rm", str(rm), "--out", str(tmp_path / "x"), "--format", "hf"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "keeps this project's format (--format native)" in err[0]
    assert not (tmp_path / "x").exists()


def classifier_dir(assets, tmp_path, arch: str, pad_is_eos: bool = False):
    """A random classifier of one label that transformers itself builds and saves, with the tiny tokenizer."""
    from transformers import (
        AutoTokenizer,
        GPT2Config,
        GPT2ForSequenceClassification,
        LlamaConfig,
        LlamaForSequenceClassification,
    )

    tok = AutoTokenizer.from_pretrained(str(assets["hf"]))
    pad = tok.eos_token_id if pad_is_eos else tok.pad_token_id
    torch.manual_seed(0)
    if arch == "llama":
        config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             num_labels=1, pad_token_id=pad)
        model = LlamaForSequenceClassification(config)
    else:
        config = GPT2Config(vocab_size=len(tok), n_embd=64, n_layer=2, n_head=4, n_positions=256, num_labels=1,
                            pad_token_id=pad)
        model = GPT2ForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)  # not the tiny default init: scores that tell positions apart
    d = tmp_path / f"{arch}_classifier"
    model.save_pretrained(str(d))
    tok.save_pretrained(str(d))
    return d, pad


@pytest.mark.parametrize("arch,pad_is_eos", [("llama", False), ("llama", True), ("gpt2", False)])
def test_a_classifier_written_by_transformers_scores_as_transformers_does(assets, tmp_path, arch, pad_is_eos):
    """The Llama runs natively (prompts shared in groups), GPT-2 through transformers; with a pad token equal to
    EOS a sequence ending in EOS is scored before it, as transformers does."""
    d, pad = classifier_dir(assets, tmp_path, arch, pad_is_eos)
    scorer = load_reward_model(d)
    assert scorer.model.backbone.native == (arch == "llama")
    eos = scorer.tokenizer.eos_id
    seqs = SEQS + [[5, 17, 42, eos]]
    want = transformers_scores(d, seqs, pad)
    torch.testing.assert_close(torch.tensor(scorer.score_ids(seqs)), torch.tensor(want), atol=1e-5, rtol=0)
    if pad_is_eos:  # the EOS made no difference: scored at the token before it, grouped too (as GRPO scores)
        assert scorer.score_ids([[5, 17, 42, eos]]) == pytest.approx(scorer.score_ids([[5, 17, 42]]), abs=1e-6)
        group = [[5, 17, 42, 9, eos], [5, 17, 42, eos], [3, 4, 6], [3, 4, 7, 7]]  # a completion of EOS alone
        torch.testing.assert_close(torch.tensor(scorer.score_ids(group, group=2)),
                                   torch.tensor(transformers_scores(d, group, pad)), atol=1e-5, rtol=0)


def test_grpo_takes_a_transformers_classifier_as_its_rm(assets, tmp_path):
    d, _ = classifier_dir(assets, tmp_path, "llama")
    prompts = tmp_path / "prompts.jsonl"
    synthetic.write_jsonl(prompts, [{"prompt": r["prompt"]} for r in synthetic.make_pairs(8, seed=1)])
    policy = tmp_path / "policy"
    shutil.copytree(assets["hf"], policy)
    out = tmp_path / "grpo"
    assert kat_train_grpo.main(["--policy", str(policy), "--rm", str(d), "--prompts", str(prompts), "--batch_size", "2",
                                "--group_size", "2", "--max_new_tokens", "4", "--max_steps", "1", "--val_ratio", "0",
                                "--log_rollouts", "--device", "cpu", "--out", str(out)]) == 0
    # each completion's reward is what transformers' classifier scores for the prompt the policy saw and it
    tok = load_tokenizer_for(load_backbone(policy), None)
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    rollouts = [json.loads(line) for line in (out / "logs" / "rollouts.jsonl").read_text().splitlines()]
    seqs = [tok.render_prompt([{"role": "user", "content": rows[r["prompt_index"]]["prompt"]}]) + r["completion_ids"]
            for r in rollouts]
    want = transformers_scores(d, seqs, tok.pad_id)
    torch.testing.assert_close(torch.tensor([r["reward"] for r in rollouts]), torch.tensor(want), atol=1e-5, rtol=0)


def ask_to_run_own_code(d, ran) -> None:
    """Python files in model dir `d` that append their name to `ran` when imported, named by config.json's and
    tokenizer_config.json's auto_map (what transformers imports only with trust_remote_code)."""
    for name, cls in (("configuration_evil", "Config"), ("modeling_evil", "Model"), ("tokenization_evil", "Tok")):
        (d / f"{name}.py").write_text(f"open({str(ran)!r}, 'a').write({name!r})\nclass Evil{cls}: pass\n")
    for file, auto_map in (("config.json", {"AutoConfig": "configuration_evil.EvilConfig",
                                            "AutoModel": "modeling_evil.EvilModel",
                                            "AutoModelForSequenceClassification": "modeling_evil.EvilModel",
                                            "AutoModelForCausalLM": "modeling_evil.EvilModel"}),
                           ("tokenizer_config.json", {"AutoTokenizer": ["tokenization_evil.EvilTok", None]})):
        config = json.loads((d / file).read_text())
        (d / file).write_text(json.dumps({**config, "auto_map": auto_map}))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_python_files_in_a_model_dir_never_run(assets, tmp_path, arch):
    """Model dirs that ask transformers to run their own code: as an RM (the Llama natively, GPT-2 through
    transformers), as a backbone (native and through transformers) and for its tokenizer, each loads as the
    architecture it names, and none of their Python files is imported (trust_remote_code is never on)."""
    ran = tmp_path / "ran"
    classifier, _ = classifier_dir(assets, tmp_path, arch, False)
    causal = shutil.copytree(assets["hf"], tmp_path / "causal")
    for d in (classifier, causal):
        ask_to_run_own_code(d, ran)
    scores = load_reward_model(classifier).score_ids(SEQS)
    backbones = [load_backbone(causal, native=native) for native in (True, False)]
    tokenizer = load_tokenizer_for(backbones[1], None)
    assert not ran.exists(), ran.read_text()
    assert len(scores) == len(SEQS) and [b.native for b in backbones] == [True, False] and tokenizer.vocab_size > 0
