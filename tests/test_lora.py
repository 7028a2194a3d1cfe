"""--lora_r: LoRA through peft for the RM and GRPO, checked against peft itself (its switched-off adapters, its own
merge, its own adapter files) and against the unmodified model, on nanochat's own checkpoint of its current vintage
(tests/fixtures/nanochat-golden) and the native Llama; 2 ranks = 1 rank over real gloo groups; the merged final
checkpoint in the input's own layout."""
from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, assert_bitwise, assert_same_update, rm_init, run_script, ulps
from safetensors.torch import load_file

from nanochat_ext.data.batching import right_pad
from nanochat_ext.errors import InputError
from nanochat_ext.models.compiled import compile_blocks
from nanochat_ext.models.gpt import GPT
from nanochat_ext.models.loader import load_backbone, load_tokenizer_for, merged_weights
from nanochat_ext.models.lora import LoraSpec, WithoutAdapters, adapter_params, apply_lora, save_adapters
from nanochat_ext.models.reward_model import load_reward_model
from nanochat_ext.runtime.checkpoint import complete_checkpoints, find_checkpoint
from nanochat_ext.tasks import synthetic
from nanochat_ext.training.logprobs import CompletionLogprobs, make_sequences
from nanochat_ext.training.memory import grpo_memory, model_shape
from scripts import kat_train_grpo, kat_train_rm

GOLDEN = REPO / "tests" / "fixtures" / "nanochat-golden" / "current"
NANOCHAT = GOLDEN / "chatsft_checkpoints" / "d2"  # written by nanochat's own code (its README)
ADAPTED = ("c_q.weight", "c_k.weight", "c_v.weight", "c_proj.weight", "c_fc.weight")  # the default targets' weights
TOKENIZER = GOLDEN / "tokenizer"


def ragged_ids(vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return right_pad([torch.randint(1, vocab, (n,), generator=g).tolist() for n in (11, 4, 7)], 0)


@pytest.mark.parametrize("which", ["nanochat", "llama"])
def test_peft_adapters_switch_off_to_the_base_merge_as_peft_does_and_round_trip_through_peft(assets, tmp_path, which):
    """The adapters switched off compute the unmodified model's logits bitwise; only adapters train, as many as the
    memory model counts; our merge (each layer's delta, onto the base as loaded) is peft's own merge_and_unload and
    computes the adapter model's logits; peft's adapter files load back onto a fresh base with peft's own loader."""
    from peft import PeftModel

    path = NANOCHAT if which == "nanochat" else assets["hf"]
    base = load_backbone(path)
    ids = ragged_ids(base.vocab_size)
    with torch.no_grad():
        want = base(ids)
    adapted = load_backbone(path)
    spec = LoraSpec(r=4, alpha=8.0)
    apply_lora(adapted, spec)
    trained = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert sum(p.numel() for p in adapted.parameters() if p.requires_grad) == adapter_params(base, spec)
    with torch.no_grad():
        assert torch.equal(adapted(ids), want)  # B starts at 0: the base's logits exactly
        for n, p in adapted.named_parameters():  # adapters that change the model
            if ".lora_B." in n:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(n)))
        got = adapted(ids)
        assert (got - want).abs().max() > 1e-2
        with adapted.adapters.disable_adapter():
            assert torch.equal(adapted(ids), want)

    merged = merged_weights(adapted)
    by_peft = copy.deepcopy(adapted).adapters.merge_and_unload().state_dict()  # peft's own merge
    assert merged.keys() == by_peft.keys() == base.model.state_dict().keys()
    for k in merged:
        torch.testing.assert_close(merged[k], by_peft[k], atol=ulps(by_peft[k]), rtol=0, msg=k)
    fresh = load_backbone(path)
    fresh.model.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids), got, atol=1e-4, rtol=1e-5)

    save_adapters(adapted, tmp_path / "adapters", load_tokenizer_for(base, TOKENIZER if which == "nanochat" else None),
                  {"path": str(path)})
    loaded = PeftModel.from_pretrained(load_backbone(path).model, str(tmp_path / "adapters"))
    reloaded = load_backbone(path)
    reloaded.model = loaded.base_model.model
    with torch.no_grad():
        assert torch.equal(reloaded(ids), got)


def test_lora_dropout_drops_in_training_micro_batches_only(assets):
    """--lora_dropout: the rollout, the reference and scoring are deterministic; a training micro-batch drops."""
    from nanochat_ext.models.lora import dropout_active

    bb = load_backbone(assets["hf"])
    apply_lora(bb, LoraSpec(4, 8.0, dropout=0.5))
    with torch.no_grad():
        for n, p in bb.named_parameters():
            if ".lora_B." in n:
                p.fill_(0.5)
        ids = ragged_ids(bb.vocab_size)
        assert torch.equal(bb(ids), bb(ids))
        with dropout_active(bb):
            assert not torch.equal(bb(ids), bb(ids))
        assert torch.equal(bb(ids), bb(ids))


def test_compiled_blocks_run_peft_layers_whole_and_as_eager():
    """--compile with LoRA: blocks holding peft's layers compile without a graph break (torch's own counters), the
    adapters switched off (GRPO's reference) as well, and on a ragged prefix-tree batch give eager's log-probs, the
    reference's and the policy's, and eager's gradients, bitwise (aot_eager: dynamo's and AOT autograd's graphs)."""
    from torch._dynamo.utils import counters

    runs = []
    for compiled in (False, True):
        bb = load_backbone(NANOCHAT)
        apply_lora(bb, LoraSpec(4, 8.0))
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for n, p in bb.named_parameters():
                if ".lora_" in n:
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
        if compiled:
            assert compile_blocks(bb, backend="aot_eager")
            counters.clear()
        model = CompletionLogprobs(bb)
        reference, out = WithoutAdapters(model, bb), []
        for prompts, completions in (([[1, 5, 7, 9], [1, 4]], [[3, 8], [6, 2, 5], [9], [4, 4, 4]]),):  # ragged rows
            batch = make_sequences(prompts, completions, 2, 0, share_prompt=True)
            args = (batch.input_ids, batch.gather, batch.target, batch.branches)
            with torch.no_grad():
                out.append(reference(*args)[0])
            logp = model(*args)[0]
            (logp * batch.mask).sum().backward()
            out.append(logp.detach())
        runs.append((out, {n: p.grad for n, p in bb.named_parameters() if p.grad is not None}))
        if compiled:
            assert not counters["graph_break"] and counters["stats"]["unique_graphs"] > 0, dict(counters["graph_break"])
    (eager, eager_grads), (comp, comp_grads) = runs
    assert all(torch.equal(a, b) for a, b in zip(eager, comp)) and len(eager) == 2
    assert eager_grads.keys() == comp_grads.keys() and all(torch.equal(eager_grads[k], comp_grads[k])
                                                           for k in eager_grads)
    assert not torch.equal(eager[0], eager[1])  # the reference is not the policy


def test_the_memory_model_counts_adapters_and_no_reference_copy_under_lora():
    """Under LoRA only the adapters hold gradients and AdamW's moments, and the reference is the base itself."""
    from nanochat_ext.models.backbone import Backbone
    from nanochat_ext.models.gpt import GPTConfig

    with torch.device("meta"):  # nanochat's d20 of today: its value-embedding gates have n_kv_head = 10 outputs
        model = GPT(GPTConfig(sequence_len=2048, vocab_size=32768, n_layer=20, n_head=10, n_kv_head=10, n_embd=1280))
    assert any("ve_gate" in n for n, _ in model.named_modules())
    s = model_shape(model)
    kw = dict(parallel="ddp", ranks=1, checkpointing=False, micro=16, prompt_len=256, new_tokens=256, rows=64,
              device="cuda")
    full = grpo_memory(s, **kw)
    n = adapter_params(Backbone("nanochat", model, "meta"), LoraSpec(16, 32.0))  # the default targets: no gates
    lora = grpo_memory(s, **kw, lora=n)
    assert n == 16 * 20 * (2 * 1280 + 3 * 2 * 1280 + 5 * 1280 + 5 * 1280)  # c_q c_k c_v c_proj, c_fc c_proj
    assert lora.parts["optimizer"] == 8 * n and lora.training["gradients"] == 4 * n and "reference" not in lora.parts
    assert full.peak() - lora.peak() > 14 * (s.params - n)  # 16 bytes a parameter, less its bf16 copy


def rm_args(assets, out, *extra) -> list[str]:
    return ["--backbone", str(NANOCHAT), "--tokenizer", str(TOKENIZER), "--pairs", str(assets["pairs"]),
            "--batch_size", "8", "--max_steps", "4", "--lr", "5e-3", "--eval_every", "0", "--log_every", "2",
            "--seed", "3", "--device", "cpu", "--max_len", "64", "--out", str(out), "--lora_r", "4", *extra]


def test_rm_lora_trains_as_one_batch_in_micro_batches_merges_and_resumes_exactly(assets, tmp_path, capsys):
    """The RM with LoRA on nanochat's current vintage: its checkpoints hold the head and the adapters only; 4
    micro-batches end where one batch does (LoRA under DDP, 2 ranks = 1: the GRPO test below); --merge_lora and
    --consolidate write the head and the merged weights, which load as an RM with no LoRA to apply and score as the
    adapters do; a run resumed from its step-2 checkpoint ends bitwise where the straight run does; a merged final
    resumes from the adapters its state keeps, bitwise."""
    one, two = tmp_path / "one", tmp_path / "two"
    assert kat_train_rm.main(rm_args(assets, one, "--save_every", "2")) == 0
    assert kat_train_rm.main(rm_args(assets, two, "--device_batch_size", "2", "--merge_lora")) == 0
    assert "lora: r 4, alpha 8, dropout 0 on c_fc,c_k,c_proj,c_q,c_v (peft): 8,704 adapter parameters" in \
        capsys.readouterr().out
    w_one = torch.load(find_checkpoint(one)[0], weights_only=True)
    assert set(w_one) - {"head.weight"} and all(".lora_" in k for k in set(w_one) - {"head.weight"})
    model_path, meta_path = find_checkpoint(two)
    state = torch.load(model_path.with_name(model_path.name.replace("model_", "state_")), weights_only=True)
    assert state["trained"].keys() == w_one.keys()
    assert json.loads(meta_path.read_text())["lora"] == {"r": 4, "alpha": 8.0, "dropout": 0.0, "targets": None,
                                                         "merged": True}
    merged = torch.load(model_path, weights_only=True)
    assert not any(".lora_" in k for k in merged) and "backbone.model.transformer.h.1.mlp.c_fc.weight" in merged
    # One batch against 4 micro-batches, by the update of the model (the base plus the adapters' delta, the head)
    # from where both started: the base and the head init_head draws for --seed 3.
    merged_one = tmp_path / "merged_one"  # --consolidate merges an adapter checkpoint
    assert kat_train_rm.main(rm_args(assets, one, "--resume", str(find_checkpoint(one)[0]), "--consolidate",
                                     str(merged_one))) == 0
    start = rm_init(NANOCHAT, seed=3)
    trained = {k for k in merged if k == "head.weight" or k.endswith(ADAPTED)}
    assert all(torch.equal(merged[k], start[k]) for k in merged if k not in trained)  # the base stays as it was
    assert_same_update({k: merged[k] for k in trained},
                       {k: v for k, v in torch.load(find_checkpoint(merged_one)[0], weights_only=True).items()
                        if k in trained}, start)

    first = complete_checkpoints(one)[-1][0]  # step 2
    resumed = tmp_path / "resumed"
    assert kat_train_rm.main(rm_args(assets, resumed, "--resume", str(first))) == 0
    w_resumed = torch.load(find_checkpoint(resumed)[0], weights_only=True)
    assert_bitwise(w_resumed, w_one)

    # the merged file loads as an RM with no LoRA to apply and scores as the adapters do; a merged final resumes from
    # the adapters its state keeps
    prompts, responses = ["How do I boil an egg?", "Name a colour."], ["Put it in boiling water.", "Blue, mostly."]
    assert load_reward_model(merged_one).score(prompts, responses) == pytest.approx(
        load_reward_model(one).score(prompts, responses), abs=1e-5)
    # A merged final resumes from the adapters its state keeps: one more step from it (--resume_extend) is one more
    # step from the same run saved unmerged (the same computation: bitwise), not a run from the base.
    plain = tmp_path / "plain"
    assert kat_train_rm.main(rm_args(assets, plain, "--device_batch_size", "2")) == 0
    extended = {}
    for name, src in (("plain", find_checkpoint(plain)[0]), ("merged", model_path)):
        assert kat_train_rm.main(rm_args(assets, tmp_path / f"{name}_5", "--resume", str(src), "--resume_extend",
                                         "--max_steps", "5", "--device_batch_size", "2")) == 0
        extended[name] = torch.load(find_checkpoint(tmp_path / f"{name}_5")[0], weights_only=True)
    assert extended["merged"].keys() == w_one.keys()
    assert_bitwise(extended["merged"], extended["plain"])
    assert all(not torch.equal(extended["merged"][k], state["trained"][k]) for k in w_one)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    rows = synthetic.make_pairs(40, seed=5)  # prompts of ragged lengths
    return synthetic.write_jsonl(tmp_path_factory.mktemp("lora") / "prompts.jsonl",
                                 [{"prompt": r["prompt"], "answer": "Sure"} for r in rows])


def grpo_args(prompts, out, *extra) -> list[str]:
    return ["--policy", str(NANOCHAT), "--tokenizer", str(TOKENIZER), "--prompts", str(prompts),
            "--reward_fn", "rewards_for_tests:vowel_share", "--batch_size", "4", "--group_size", "4",
            "--max_new_tokens", "8", "--max_steps", "2", "--beta", "0.04", "--lr", "1e-2", "--log_every", "1",
            "--device", "cpu", "--out", str(out), "--lora_r", "4", "--log_rollouts", *extra]


def test_grpo_lora_on_two_ranks_trains_as_one_from_its_base_and_merges_into_nanochats_layout(prompts, tmp_path):
    """GRPO with LoRA on nanochat's current vintage, ragged prompts: the reference is the policy with its adapters
    off (a KL of exactly 0 at step 1, no second model); 2 ranks sample and train what 1 rank does; the adapter
    checkpoint loads as a model (peft's loader and merge) and resumes bitwise; --merge_lora's final checkpoint has the
    golden fixture's keys, shapes and dtypes, changes only the adapted weights, and by as much as the 1-rank run's
    adapters merged by peft; it resumes from the adapters its state keeps, bitwise."""
    one, two = tmp_path / "one", tmp_path / "two"
    sys.path.insert(0, str(REPO / "tests"))  # the reward functions, in-process
    assert kat_train_grpo.main(grpo_args(prompts, one, "--save_every", "1")) == 0
    ran = run_script("scripts.kat_train_grpo", grpo_args(prompts, two, "--device_batch_size", "4", "--merge_lora"),
                     nproc=2, env={"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"})
    assert ran.returncode == 0, ran.stderr
    assert "reference the base, adapters off" in ran.stdout
    logs = [[json.loads(line) for line in (d / "logs" / "metrics.jsonl").read_text().splitlines()] for d in (one, two)]
    assert [m["train/kl"] for m in logs[0] if "train/kl" in m][0] == 0.0
    rollouts = [[(r["prompt_index"], r["completion_ids"]) for r in map(json.loads, (
        d / "logs" / "rollouts.jsonl").read_text().splitlines())] for d in (one, two)]
    assert len(rollouts[0]) == 2 * 4 * 4 and rollouts[0] == rollouts[1]

    final_one = find_checkpoint(one)[0]
    assert final_one.is_dir() and (final_one / "adapter_config.json").is_file()
    adapters = load_file(final_one / "adapter_model.safetensors")
    model_path = find_checkpoint(two)[0]
    state = torch.load(model_path.with_name(model_path.name.replace("model_", "state_")), weights_only=True)
    assert state["adapters"].keys() == adapters.keys()

    golden = torch.load(next(NANOCHAT.glob("model_*.pt")), weights_only=True)
    merged = torch.load(model_path, weights_only=True)
    assert {k: (v.shape, v.dtype) for k, v in merged.items()} == {k: (v.shape, v.dtype) for k, v in golden.items()}
    adapted = {k for k in golden if k.endswith(ADAPTED)}
    assert all(torch.equal(merged[k], golden[k]) for k in golden if k not in adapted)
    # 2 ranks against 1 by the update of the model: the merged final (2 ranks) and the adapters loaded by peft and
    # merged (1 rank), each a distance from the base
    by_peft = load_backbone(one).model.state_dict()
    assert_same_update({k: merged[k] for k in adapted}, {k: by_peft[k] for k in adapted}, golden)

    resumed = tmp_path / "resumed"
    first = complete_checkpoints(one)[-1][0]  # step 1
    assert kat_train_grpo.main(grpo_args(prompts, resumed, "--resume", str(first))) == 0
    again = load_file(find_checkpoint(resumed)[0] / "adapter_model.safetensors")
    assert_bitwise(again, adapters)
    # A merged final resumes from the adapters its state keeps: one more step from it (--resume_extend) is one more
    # step from the same run saved unmerged (the same computation: bitwise), not a run from the base.
    merged_one = tmp_path / "merged_one"
    assert kat_train_grpo.main(grpo_args(prompts, merged_one, "--merge_lora")) == 0
    extended = {}
    for name, src in (("adapters", final_one), ("merged", find_checkpoint(merged_one)[0])):
        assert kat_train_grpo.main(grpo_args(prompts, tmp_path / name, "--resume", str(src), "--resume_extend",
                                             "--max_steps", "3")) == 0
        extended[name] = load_file(find_checkpoint(tmp_path / name)[0] / "adapter_model.safetensors")
    assert_bitwise(extended["merged"], extended["adapters"])
    assert all(not torch.equal(extended["merged"][k], adapters[k]) for k in adapters)


def test_an_adapter_checkpoint_is_refused_once_its_base_changed(prompts, tmp_path):
    """An adapter checkpoint names its base by path and fingerprint: it loads as a model while the base is the one it
    trained on, and is refused in one line once the base's weights changed (retrained in place, say)."""
    base = tmp_path / "base"
    shutil.copytree(NANOCHAT, base)
    out = tmp_path / "lora"
    sys.path.insert(0, str(REPO / "tests"))  # the reward functions, in-process
    args = grpo_args(prompts, out, "--max_steps", "1")
    args[args.index("--policy") + 1] = str(base)
    assert kat_train_grpo.main(args) == 0
    load_backbone(out)
    weights_file = next(base.glob("model_*.pt"))
    weights = torch.load(weights_file, weights_only=True)
    weights["transformer.h.0.attn.c_q.weight"] += 1e-3
    torch.save(weights, weights_file)
    with pytest.raises(InputError, match=r"the base model .* is not the one these adapters were trained on: its "
                                         r"weights differ \(fingerprint\)"):
        load_backbone(out)


def starts_at_its_reference_and_merges_onto_the_source(source: Path, prompts: Path, out: Path, *flags: str) -> None:
    """GRPO with LoRA from nanochat checkpoint `source` under `flags` (a device, a dtype, --compile): step 1's KL is 0
    but for rounding (the reference is the base with the adapters off), and the merged final is merged onto the fp32
    base as loaded, not the bf16 copy training held (untargeted tensors the source's, bitwise)."""
    sys.path.insert(0, str(REPO / "tests"))  # the reward functions, in-process
    assert kat_train_grpo.main(["--policy", str(source), "--prompts", str(prompts), "--reward_fn",
                                "rewards_for_tests:vowel_share", "--batch_size", "2", "--group_size", "2",
                                "--max_new_tokens", "4", "--max_steps", "1", "--out", str(out), "--lora_r", "8",
                                "--merge_lora", *flags]) == 0
    rows = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert 0 <= [r["train/kl"] for r in rows if "train/kl" in r][0] < 1e-5
    source_weights = torch.load(next(source.glob("model_*.pt")), weights_only=True)
    merged = torch.load(find_checkpoint(out)[0], weights_only=True)
    assert {k: v.dtype for k, v in merged.items()} == {k: v.dtype for k, v in source_weights.items()}
    assert torch.equal(merged["transformer.wte.weight"], source_weights["transformer.wte.weight"])
    assert not torch.equal(merged["transformer.h.0.attn.c_q.weight"], source_weights["transformer.h.0.attn.c_q.weight"])


@pytest.mark.usefixtures("scalar_kernels")
def test_grpo_lora_in_bf16_compiled_starts_at_its_reference_and_merges(assets, tmp_path):
    """The CUDA LoRA test's CPU twin: bf16 autocast (the frozen base's matmul weights in bf16, the engine's bf16
    copy of the adapters), compiled blocks and the compiled engine (inductor), LoRA. The reference is the base with
    the adapters off, so step 1's KL is 0 but for bf16 rounding: inductor fuses the training graph and the
    reference's inference graph differently and rounds their bf16 intermediates at other places (measured 6e-7;
    eager, or fp32 compiled: exactly 0; any other reference: ~1). On the classic vintage (one block graph; the CUDA
    twin, test_cuda.py, runs today's vintage with value embeddings)."""
    # --val_ratio 0: no held-out prompts, so no final evaluation (not checked here), whose greedy decoding would
    # compile the decode step a second time (~20 s of the test's ~125 on 2 cores)
    starts_at_its_reference_and_merges_onto_the_source(assets["gpt"], assets["pairs"], tmp_path / "lora",
                                                       "--device", "cpu", "--dtype", "bfloat16", "--compile", "1",
                                                       "--val_ratio", "0")
