"""Real nanochat checkpoints, proven against nanochat's own forward pass.

tests/fixtures/nanochat-golden/<vintage>/ holds, for seven nanochat commits (Oct 2025 .. today), a
chat-SFT checkpoint dir written by that commit's own save_checkpoint, its tokenizer, and golden.pt with
the logits that commit's own loader and forward pass gave (CPU, fp32). See its README.md.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO, assert_same_update, run_script

from nanochat_ext.errors import InputError
from nanochat_ext.models.attention import PrefixTree
from nanochat_ext.models.loader import load_backbone, load_tokenizer_for
from nanochat_ext.models.vintages import VINTAGES
from nanochat_ext.runtime.checkpoint import find_checkpoint, resolve_model_path
from nanochat_ext.tasks import synthetic
from scripts import kat_train_grpo

GOLDEN = REPO / "tests" / "fixtures" / "nanochat-golden"
FIXTURES = sorted(p.name for p in GOLDEN.iterdir() if (p / "golden.pt").is_file())
AMBIGUOUS = {"mar2026a"}  # same keys, shapes and meta as feb2026: refused unless the user names it


def fixture_dir(name: str) -> Path:
    return GOLDEN / name / "chatsft_checkpoints" / "d2"


def vintage_of(name: str) -> str:
    """A fixture's vintage: its dir's name, less a depth suffix (current-d4: today's nanochat at 4 layers, where
    backout acts before the last block; at 2 layers the final norm cancels it)."""
    return name.removesuffix("-d4")


def test_every_vintage_has_a_fixture():
    """Every vintage nanochat wrote; transformers' port of nanochat is checked against transformers' forward
    (test_zoo.py)."""
    assert {vintage_of(n) for n in FIXTURES} == set(VINTAGES) - {"transformers"} and "current-d4" in FIXTURES


@pytest.mark.parametrize("name", FIXTURES)
def test_logits_match_nanochat(name):
    """Loaded from nanochat's own dir (zero-padded model_000010.pt), the logits are nanochat's to 1e-4."""
    golden = torch.load(GOLDEN / name / "golden.pt", weights_only=True)
    if name in AMBIGUOUS:
        with pytest.raises(InputError, match=r"feb2026 .*softcap 15.*mar2026a .*softcap 20.*--nanochat_vintage"):
            load_backbone(fixture_dir(name))
    bb = load_backbone(fixture_dir(name), vintage=name if name in AMBIGUOUS else None)
    assert bb.vintage == vintage_of(name) and bb.source.endswith("model_000010.pt")
    worst = 0.0
    with torch.no_grad():
        for x, pos, ref in zip(golden["inputs"], golden["positions"], golden["logits"]):
            out = bb.model(x)[:, pos, :golden["vocab_size"]]
            worst = max(worst, (out - ref).abs().max().item())
    print(f"golden {name}: max |logit diff| {worst:.2e}")
    assert worst < 1e-4
    # The tokenizer renders the chat exactly as nanochat did (the first golden input).
    tok = load_tokenizer_for(bb, None)
    user, assistant = golden["conversation"]["messages"]
    assert tok.render_prompt([user]) + tok.render_response(assistant["content"]) == golden["inputs"][0][0].tolist()


@pytest.mark.parametrize("name", FIXTURES)
def test_ragged_batches_match_nanochat(name):
    """Rows of different lengths in one batch, as the trainers build them, still give nanochat's logits:
    right-padded (RM scoring, log-probs) and left-padded with a key mask (sampling), the latter with
    more padding than the short window so windows and padding interact."""
    golden = torch.load(GOLDEN / name / "golden.pt", weights_only=True)
    bb = load_backbone(fixture_dir(name), vintage=vintage_of(name))
    long_row, rows60 = golden["inputs"][3][0], golden["inputs"][2]  # 300 tokens; 2 x 60 tokens
    want_long, want60 = golden["logits"][3][0], golden["logits"][2]  # long row: positions 236..299 only
    n = 35  # a causal prefix of row 1: its logits are the first n of nanochat's
    with torch.no_grad():
        right = torch.zeros(2, 60, dtype=torch.long)
        right[0], right[1, :n] = rows60[0], rows60[1, :n]
        out = bb.model(right)
        torch.testing.assert_close(out[0], want60[0], atol=1e-4, rtol=0)
        torch.testing.assert_close(out[1, :n], want60[1, :n], atol=1e-4, rtol=0)
        left = torch.zeros(2, 300, dtype=torch.long)
        key_mask = torch.zeros(2, 300, dtype=torch.bool)
        left[0], key_mask[0] = long_row, True
        left[1, 300 - 60:], key_mask[1, 300 - 60:] = rows60[0], True
        out = bb.model(left, key_mask=key_mask)
        torch.testing.assert_close(out[0, 236:], want_long, atol=1e-4, rtol=0)
        torch.testing.assert_close(out[1, 300 - 60:], want60[0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", FIXTURES)
def test_scored_position_path_matches_nanochat(name):
    """The RM's path (the last block at each row's scored position only), on right-padded rows of 300, 60
    and 35 tokens in one batch: the logits there are nanochat's own."""
    golden = torch.load(GOLDEN / name / "golden.pt", weights_only=True)
    bb = load_backbone(fixture_dir(name), vintage=vintage_of(name))
    long_row, rows60 = golden["inputs"][3][0], golden["inputs"][2]
    want_long, want60 = golden["logits"][3][0], golden["logits"][2]  # long row: positions 236..299
    n = 35
    ids = torch.zeros(3, 300, dtype=torch.long)
    ids[0], ids[1, :60], ids[2, :n] = long_row, rows60[0], rows60[1, :n]
    with torch.no_grad():
        got = bb.model.logits(bb.model.hidden_states(ids, at=torch.tensor([299, 59, n - 1])))
    want = torch.stack([want_long[-1], want60[0, 59], want60[1, n - 1]])
    torch.testing.assert_close(got[:, :golden["vocab_size"]], want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", FIXTURES)
def test_prefix_tree_rows_match_nanochat(name):
    """The RM's pair rows (PrefixTree: a shared prefix once, then two branches that never see each other),
    three rows in one batch: the 300-token row as a 240-token prefix with branches of its next 60 and
    next 30 tokens (positions past the short window); the two 60-token rows as branches of an empty
    prefix; a 60-token row's first 35 tokens as prefix, branches of 1 and 25 tokens. Every branch token's
    logits, and those of the scored-position path at the branch ends, are nanochat's own."""
    golden = torch.load(GOLDEN / name / "golden.pt", weights_only=True)
    bb = load_backbone(fixture_dir(name), vintage=vintage_of(name))
    long_row, rows60 = golden["inputs"][3][0], golden["inputs"][2]
    want_long, want60 = golden["logits"][3][0], golden["logits"][2]  # long row: positions 236..299
    V = golden["vocab_size"]
    rows = [(long_row[:240], long_row[240:], long_row[240:270]), (long_row[:0], rows60[0], rows60[1]),
            (rows60[1, :35], rows60[1, 35:36], rows60[1, 35:])]
    wants = [(want_long[4:], want_long[4:34]), (want60[0], want60[1]), (want60[1, 35:36], want60[1, 35:])]
    lengths = torch.tensor([[len(part) for part in row] for row in rows])
    ids = torch.zeros(3, int(lengths.sum(-1).max()), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :lengths[i].sum()] = torch.cat(row)
    tree = PrefixTree.from_lengths(lengths)
    with torch.no_grad():
        logits = bb.model.logits(bb.model.hidden_states(ids, tree=tree))[..., :V]
        ends = bb.model.logits(bb.model.hidden_states(ids, at=tree.ends, tree=tree))[..., :V]
    for i, (want_a, want_b) in enumerate(wants):
        prefix, a, b = lengths[i].tolist()
        torch.testing.assert_close(logits[i, prefix:prefix + a], want_a, atol=1e-4, rtol=0, msg=f"row {i} branch a")
        torch.testing.assert_close(logits[i, prefix + a:prefix + a + b], want_b, atol=1e-4, rtol=0,
                                   msg=f"row {i} branch b")
        torch.testing.assert_close(ends[i], torch.stack([want_a[-1], want_b[-1]]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", FIXTURES)
def test_static_decode_step_matches_nanochat(name):
    """--compile's decode step (static cache written at a slot, masks from key_valid), eager here and
    compiled for today's layout: left-padded prompts of 290 and 50 tokens, then six of their own next
    tokens one at a time; every step's logits are nanochat's at those positions. Compiled through dynamo and AOT
    autograd (the graph --compile captures, its guards and static cache) without inductor's code generation, whose
    C++ compile of this step took 38 of the test's 43 s: inductor's numerics on the decode step are test_engine's
    test_runner's test_inductor_engine_keeps_its_state_and_graph (eager's tokens, a re-forward's),
    on nanochat's current GPT."""
    golden = torch.load(GOLDEN / name / "golden.pt", weights_only=True)
    bb = load_backbone(fixture_dir(name), vintage=vintage_of(name))
    long_row, row60 = golden["inputs"][3][0], golden["inputs"][2][0]
    want_long, want60 = golden["logits"][3][0], golden["logits"][2][0]
    rows, lengths, P, L, steps = [long_row, row60], [290, 50], 290, 320, 6
    ids, key_mask = torch.zeros(2, P, dtype=torch.long), torch.zeros(2, P, dtype=torch.bool)
    for i, (row, k) in enumerate(zip(rows, lengths)):
        ids[i, P - k:], key_mask[i, P - k:] = row[:k], True
    for compiled in (False, True) if name == "current-d4" else (False,):
        step = torch.compile(bb.model.decode_step, backend="aot_eager", dynamic=False) if compiled \
            else bb.model.decode_step
        with torch.no_grad():
            _, cache = bb.prefill(ids, key_mask, L)
            key_valid = torch.zeros(2, L, dtype=torch.bool)
            key_valid[:, :P] = key_mask
            positions = key_mask.sum(-1)
            for t in range(steps):
                key_valid[:, P + t] = True
                cache.slot = torch.tensor([P + t])
                tokens = torch.stack([row[k + t] for row, k in zip(rows, lengths)])
                got = step(tokens, positions, key_valid, cache)[:, :golden["vocab_size"]]
                positions = positions + 1
                want = torch.stack([want_long[290 + t - 236], want60[50 + t]])
                torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=f"{name} step {t} compiled {compiled}")


def test_a_wrong_vintage_is_really_wrong():
    """The tolerance separates vintages: feb2026's weights run as mar2026a are off by far more than 1e-4."""
    golden = torch.load(GOLDEN / "feb2026" / "golden.pt", weights_only=True)
    bb = load_backbone(fixture_dir("feb2026"), vintage="mar2026a")
    with torch.no_grad():
        assert (bb.model(golden["inputs"][0]) - golden["logits"][0]).abs().max() > 0.1


@pytest.mark.parametrize("name", FIXTURES)
def test_left_padded_prompts_give_unpadded_logits(name):
    """Each left-padded row counts positions from its own first token: prefill and every decode step
    give the unpadded logits (smear, sliding windows and bf16 rotary tables included)."""
    bb = load_backbone(fixture_dir(name), vintage=vintage_of(name))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (n,), generator=g) for n in (5, 300, 9)]  # 300 > the short windows
    P, steps = 300, 6
    ids, key_mask = torch.zeros(3, P, dtype=torch.long), torch.zeros(3, P, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):], key_mask[i, P - len(p):] = p, True
    new = torch.randint(0, 500, (3, steps), generator=g)
    with torch.no_grad():
        logits, cache = bb.prefill(ids, key_mask, P + steps)
        got = [logits]
        for t in range(steps - 1):
            key_mask = torch.cat([key_mask, torch.ones(3, 1, dtype=torch.bool)], 1)
            got.append(bb.decode(cache, new[:, t], key_mask))
        for i, p in enumerate(prompts):
            want = bb.model(torch.cat([p, new[i, :-1]])[None])[0, len(p) - 1:]
            torch.testing.assert_close(torch.stack([x[i] for x in got]), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("native", [True, False])
def test_left_padding_is_exact_for_hf_models_too(assets, native):
    bb = load_backbone(assets["hf"], native=native)
    prompts = [torch.tensor([5, 17, 42]), torch.tensor(list(range(20, 40)))]
    P = 20
    ids, key_mask = torch.zeros(2, P, dtype=torch.long), torch.zeros(2, P, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):], key_mask[i, P - len(p):] = p, True
    with torch.no_grad():
        logits, cache = bb.prefill(ids, key_mask, P + 2)
        key_mask = torch.cat([key_mask, torch.ones(2, 1, dtype=torch.bool)], 1)
        step = bb.decode(cache, torch.tensor([7, 8]), key_mask)
        for i, p in enumerate(prompts):
            want = bb(torch.cat([p, torch.tensor([7 + i])])[None])[0, -2:]
            torch.testing.assert_close(torch.stack([logits[i], step[i]]), want, atol=1e-5, rtol=0)


# ---- what nanochat users type -------------------------------------------------------------------
@pytest.fixture
def base_dir(tmp_path, monkeypatch) -> Path:
    """A $NANOCHAT_BASE_DIR as nanochat lays it out: tokenizer/, chatsft_checkpoints/{d2,d12}."""
    base = tmp_path / "base"
    shutil.copytree(GOLDEN / "current", base)
    shutil.copytree(base / "chatsft_checkpoints" / "d2", base / "chatsft_checkpoints" / "d12")
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    return base


def test_short_forms_and_checkpoint_roots(base_dir):
    sft = base_dir / "chatsft_checkpoints"
    assert resolve_model_path("sft") == sft / "d12"  # the largest d<N>, as nanochat's find_largest_model
    assert resolve_model_path("sft:d2") == sft / "d2"
    assert resolve_model_path(sft) == sft / "d12"
    for spec in ("sft", "sft:d2", str(sft), str(sft / "d2"), str(sft / "d2" / "model_000010.pt")):
        assert load_backbone(spec).vintage == "current", spec
    # Several steps in one dir: the largest number wins, zero-padded or not.
    d2 = sft / "d2"
    shutil.copy(d2 / "model_000010.pt", d2 / "model_000200.pt")
    shutil.copy(d2 / "meta_000010.json", d2 / "meta_000200.json")
    assert load_backbone(d2).source.endswith("model_000200.pt")


def test_bad_checkpoints_are_one_clear_line(base_dir, tmp_path):
    sft = base_dir / "chatsft_checkpoints"
    with pytest.raises(InputError,
                       match=r"no checkpoint tag 'd99' under .*chatsft_checkpoints \(tags there: d12, d2\)"):
        load_backbone("sft:d99")
    only_model, only_meta = tmp_path / "only_model", tmp_path / "only_meta"
    only_model.mkdir(), only_meta.mkdir()
    shutil.copy(sft / "d2" / "model_000010.pt", only_model)
    shutil.copy(sft / "d2" / "meta_000010.json", only_meta)
    with pytest.raises(InputError, match="model_000010.pt has no matching meta"):
        load_backbone(only_model)
    with pytest.raises(InputError, match="meta_000010.json has no matching model"):
        load_backbone(only_meta)
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    shutil.copy(sft / "d2" / "model_000010.pt", no_config)
    (no_config / "meta_000010.json").write_text(json.dumps({"step": 10}))
    with pytest.raises(InputError, match="meta_000010.json: field 'model_config'"):
        load_backbone(no_config)
    # An unknown layout: every missing / unexpected key (layers folded) and the vintages we know.
    state = torch.load(sft / "d2" / "model_000010.pt", weights_only=True)
    state["transformer.h.0.attn.engram.weight"] = state["transformer.h.1.attn.engram.weight"] = torch.zeros(2)
    del state["value_embeds.1.weight"]
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    torch.save(state, foreign / "model_000010.pt")
    shutil.copy(sft / "d2" / "meta_000010.json", foreign)
    with pytest.raises(InputError) as e:
        load_backbone(foreign)
    msg = str(e.value)
    assert "missing [value_embeds.{1}.weight]" in msg and "unexpected [transformer.h.{0,1}.attn.engram.weight]" in msg
    assert all(v in msg for v in VINTAGES)
    # A tokenizer whose vocabulary is not the checkpoint's.
    small = tmp_path / "small_tok"
    synthetic.make_tokenizer(small, vocab_size=400)
    with pytest.raises(InputError,
                       match=r"tokenizer has 400 ids but the backbone's vocab_size is 500 \(512 embedding rows\)"):
        load_tokenizer_for(load_backbone("sft:d2"), small)


def test_a_bad_tag_stops_a_script_with_exit_2(base_dir, tmp_path):
    prompts = synthetic.write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}] * 4)
    out = tmp_path / "out"
    proc = run_script("scripts.kat_train_grpo", ["--policy", "sft:d99", "--prompts", str(prompts), "--out", str(out),
                                                 "--eval_prompts", str(prompts), "--batch_size", "2",
                                                 "--reward_fn", "rewards_for_tests:vowel_share"],
                      env={"NANOCHAT_BASE_DIR": str(base_dir), "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"})
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: 'sft:d99'")
    assert not out.exists()


# ---- GRPO on real checkpoints ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def ragged_prompts(tmp_path_factory) -> Path:
    """Prompts of very different lengths, so left padding is always in play."""
    words = "the comet orbit passes near our small blue planet every few years and we watch it".split()
    rows = [{"prompt": " ".join(words[: 1 + (7 * i) % len(words)]) * (1 + i % 3)} for i in range(16)]
    return synthetic.write_jsonl(tmp_path_factory.mktemp("ragged") / "prompts.jsonl", rows)


def grpo_argv(name: str, prompts: Path, out: Path, *extra: str) -> list[str]:
    return ["--policy", str(fixture_dir(name)), "--prompts", str(prompts), "--reward_fn",
            "rewards_for_tests:vowel_share", "--batch_size", "4", "--group_size", "4", "--max_new_tokens", "6",
            "--device", "cpu", "--eval_prompts", str(prompts), "--out", str(out), *extra]


@pytest.mark.parametrize("name", FIXTURES)
def test_grpo_round_trip_keeps_the_layout(name, ragged_prompts, tmp_path):
    """A policy trained from a vintage-X checkpoint is saved in X's layout (keys, shapes, dtypes, the
    model_config verbatim, token_bytes.pt beside it) and reloads to the same logits."""
    flag = ["--nanochat_vintage", name] if name in AMBIGUOUS else []
    out = tmp_path / "rl"
    assert kat_train_grpo.main(grpo_argv(name, ragged_prompts, out, "--max_steps", "1", "--lr", "1e-2", *flag)) == 0
    (saved,) = out.glob("model_*.pt")
    src = torch.load(fixture_dir(name) / "model_000010.pt", weights_only=True)
    got = torch.load(saved, weights_only=True)
    assert {k: (v.shape, v.dtype) for k, v in got.items()} == {k: (v.shape, v.dtype) for k, v in src.items()}
    assert any((got[k] - src[k]).abs().max() > 1e-4 for k in src)  # it did train
    src_meta = json.loads((fixture_dir(name) / "meta_000010.json").read_text())
    meta = json.loads(next(out.glob("meta_*.json")).read_text())
    assert meta["model_config"] == src_meta["model_config"] and meta["nanochat_vintage"] == vintage_of(name)
    assert (out / "token_bytes.pt").read_bytes() == (GOLDEN / name / "tokenizer" / "token_bytes.pt").read_bytes()
    reloaded = load_backbone(out)  # no flag needed any more: our meta records the vintage
    in_memory = load_backbone(fixture_dir(name), vintage=vintage_of(name))
    in_memory.model.load_state_dict(got)
    x = torch.randint(0, 500, (2, 40))
    with torch.no_grad():
        assert torch.equal(reloaded.model(x), in_memory.model(x))  # the same weights through the same code: bitwise


def test_grpo_two_ranks_match_one_rank_on_ragged_prompts(ragged_prompts, tmp_path):
    """Today's nanochat at 4 layers (smear, windows, a backout that acts), prompts of different lengths: 1 rank, 2
    DDP ranks and 2 FSDP ranks (--parallel fsdp, decoding from a whole copy gathered from the shards) sample the
    same completions and end with the same weights, every tensor trained; FSDP's final checkpoint is whole, in
    nanochat's own layout (the fixture's keys, shapes and dtypes)."""
    # 16 new tokens: 2 of the 32 completions stop early at 4 layers (ragged completions too)
    common = ["--max_steps", "2", "--lr", "1e-4", "--beta", "0.04", "--log_rollouts", "--log_every", "1",
              "--max_new_tokens", "16"]
    env = {"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
    # one rank in this process (a launch would cost more than its two steps), the reward functions importable here
    assert kat_train_grpo.main(grpo_argv("current-d4", ragged_prompts, tmp_path / "one", *common)) == 0
    runs = {}
    for mode in ("ddp", "fsdp"):
        runs[mode] = run_script("scripts.kat_train_grpo", grpo_argv("current-d4", ragged_prompts, tmp_path / mode,
                                                                    *common, "--parallel", mode), nproc=2, env=env)
    for proc in runs.values():
        assert proc.returncode == 0, proc.stderr
    assert "from a whole copy gathered from the shards per rollout" in runs["fsdp"].stdout
    rollouts = {run: [json.loads(x) for x in (tmp_path / run / "logs" / "rollouts.jsonl").read_text().splitlines()]
                for run in ("one", "ddp", "fsdp")}
    assert len(rollouts["one"]) == 2 * 4 * 4
    assert len({len(r["completion_ids"]) for r in rollouts["one"]}) > 1  # ragged completions too
    for run in ("ddp", "fsdp"):
        assert [r["completion_ids"] for r in rollouts["one"]] == [r["completion_ids"] for r in rollouts[run]]
    trained = {run: load_backbone(tmp_path / run).model.state_dict() for run in rollouts}
    init = load_backbone(fixture_dir("current-d4")).model.state_dict()
    for a, b in (("one", "ddp"), ("one", "fsdp"), ("ddp", "fsdp")):
        assert_same_update(trained[b], trained[a], init)  # backout_lambda included: it has a gradient at 4 layers
    saved = torch.load(find_checkpoint(tmp_path / "fsdp")[0], weights_only=True)
    golden = torch.load(find_checkpoint(fixture_dir("current-d4"))[0], weights_only=True)
    assert {k: (v.shape, v.dtype) for k, v in saved.items()} == {k: (v.shape, v.dtype) for k, v in golden.items()}


def zero_reward_argv(policy: Path, prompts: Path, out: Path, dtype: str) -> list[str]:
    """Every reward 0, so every advantage 0, with the KL term on (--beta 0.04) and a large lr."""
    argv = grpo_argv("current", prompts, out, "--max_steps", "2", "--beta", "0.04", "--lr", "1e-2", "--dtype", dtype,
                     "--log_every", "1")
    argv[argv.index("--policy") + 1], argv[argv.index("--reward_fn") + 1] = str(policy), "rewards_for_tests:zero"
    return argv


def assert_unchanged(policy: Path, out: Path) -> None:
    """Every weight bitwise as it started, and both steps logged a KL and a gradient of exactly 0."""
    before, after = load_backbone(policy).model.state_dict(), load_backbone(out).model.state_dict()
    for k, v in before.items():
        assert torch.equal(v, after[k]), (k, (v - after[k]).abs().max())
    logged = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [(m["train/kl"], m["train/grad_norm"]) for m in logged if "train/kl" in m] == [(0.0, 0.0)] * 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("policy", ["current", "llama"])
def test_zero_advantages_leave_the_policy_unchanged(assets, ragged_prompts, tmp_path, policy, dtype):
    """The policy's, the old policy's and the reference's log-probs come from one code path, so at equal
    weights they are bitwise equal and the KL term's gradient is exactly 0: nothing moves the policy, in fp32
    and under bf16 autocast. It failed when the reference's frozen weights made torch's matmul take a bmm
    where the policy's took one mm (nanochat's sliced gate inputs), and when the reference held its
    embeddings in bf16 (Adam turned the 1e-8..1e-5 gradients into lr-sized steps)."""
    src = fixture_dir("current") if policy == "current" else assets["hf"]
    out = tmp_path / "out"
    assert kat_train_grpo.main(zero_reward_argv(src, ragged_prompts, out, dtype)) == 0
    assert_unchanged(src, out)


def test_zero_advantages_leave_the_policy_unchanged_on_two_ranks(ragged_prompts, tmp_path):
    out = tmp_path / "two"
    env = {"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
    proc = run_script("scripts.kat_train_grpo", zero_reward_argv(fixture_dir("current"), ragged_prompts, out,
                                                                 "bfloat16"), nproc=2, env=env)
    assert proc.returncode == 0, proc.stderr
    assert_unchanged(fixture_dir("current"), out)
