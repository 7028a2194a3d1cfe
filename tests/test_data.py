"""Pair formats, weights, the prompt-keyed split, truncation and the global-batch loader."""
from __future__ import annotations

import hashlib

import pytest

from nanochat_ext.data.batching import BatchPlan, GlobalBatchLoader, TokenizedPair, by_length, collate_pairs, truncate
from nanochat_ext.data.rows import load_pairs, parse_pair, prefix_id_of, split_by_prefix
from nanochat_ext.errors import InputError
from nanochat_ext.tasks.synthetic import make_pairs, write_jsonl

USER = [{"role": "user", "content": "What is  rain?"}]


@pytest.mark.parametrize("row", [
    {"prompt": "What is  rain?", "chosen": "Water.", "rejected": "Go away."},
    {"prompt": USER, "chosen": [{"role": "assistant", "content": "Water."}], "rejected": "Go away."},
    {"chosen": USER + [{"role": "assistant", "content": "Water."}],
     "rejected": USER + [{"role": "assistant", "content": "Go away."}]},
    {"chosen": "\n\nHuman: What is  rain?\n\nAssistant: Water.",
     "rejected": "\n\nHuman: What is  rain?\n\nAssistant: Go away."},
    {"id": 7, "prefix": {"messages": USER}, "chosen": "Water.", "rejected": "Go away.", "src": "x", "prefix_id": None},
])
def test_every_format_parses_to_the_same_pair(row):
    row = {k: v for k, v in row.items() if v is not None}
    pair = parse_pair(row, "f.jsonl", 1)
    assert pair.prompt == USER and (pair.chosen, pair.rejected, pair.weight) == ("Water.", "Go away.", 1.0)
    # The fork's rule: md5 of the whitespace-normalised first user message, 16 hex chars.
    assert pair.prefix_id == hashlib.md5(b"What is rain?").hexdigest()[:16] == prefix_id_of(USER)


def test_multi_turn_hh_transcript_keeps_the_history():
    text = "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Rain?\n\nAssistant: "
    pair = parse_pair({"chosen": text + "Water.", "rejected": text + "No."}, "f", 1)
    assert [m["role"] for m in pair.prompt] == ["user", "assistant", "user"]
    assert pair.chosen == "Water." and pair.rejected == "No."


def test_explicit_weight_and_prefix_id_are_kept():
    pair = parse_pair({"prompt": "x", "chosen": "a", "rejected": "b", "weight": 2, "prefix_id": "abc"}, "f", 1)
    assert (pair.weight, pair.prefix_id) == (2.0, "abc")


def test_conversations_that_diverge_before_the_answer_are_rejected():
    with pytest.raises(InputError, match="f:3: field 'rejected': chosen and rejected must share"):
        parse_pair({"chosen": USER + [{"role": "assistant", "content": "a"}],
                    "rejected": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "b"}]}, "f", 3)


def test_split_is_keyed_by_prompt(tmp_path):
    rows, _ = load_pairs(write_jsonl(tmp_path / "p.jsonl", make_pairs(500, seed=1)))
    train, val = split_by_prefix(rows, 0.2)
    assert len(train) + len(val) == 500 and 0.05 < len(val) / 500 < 0.4
    assert not {r.prefix_id for r in train} & {r.prefix_id for r in val}
    assert split_by_prefix(rows, 0.2) == (train, val)  # deterministic


def test_truncation_cuts_prompt_left_and_response_right():
    bos = 0
    prompt, response = [bos] + list(range(1, 20)), list(range(100, 130))
    out = truncate(prompt, response, 24, bos)
    assert len(out) == 24
    assert out[0] == bos and out[1:12] == list(range(9, 20))  # BOS, then the prompt's last 11 tokens
    assert out[12:] == response[:12]  # the prompt keeps half the budget, the response the rest
    assert truncate([1, 2], [3], 10, None) == [1, 2, 3]
    # A short prompt lets the response take the rest.
    assert truncate([bos, 5], list(range(50)), 10, bos) == [bos, 5] + list(range(8))


def test_batch_plan():
    plan = BatchPlan.make(32, 4, 2)
    assert (plan.per_rank, plan.accum_steps) == (8, 4)
    assert BatchPlan.make(32, 2, None).accum_steps == 1
    with pytest.raises(InputError, match="does not split over 3 ranks"):
        BatchPlan.make(32, 3, None)
    with pytest.raises(InputError, match="does not divide"):
        BatchPlan.make(32, 2, 5)


@pytest.mark.parametrize("world,dbs", [(2, 4), (4, 1), (2, 2)])
def test_global_batch_is_the_same_set_whatever_the_world_size(world, dbs):
    n, batch, seed = 103, 8, 5
    single = GlobalBatchLoader(n, BatchPlan.make(batch, 1, None), 0, seed)
    shards = [GlobalBatchLoader(n, BatchPlan.make(batch, world, dbs), r, seed) for r in range(world)]
    assert all(s.steps_per_epoch == single.steps_per_epoch == 12 for s in shards)
    for step in (0, 1, 11, 12, 30):  # across epoch boundaries: set_epoch reshuffles identically
        expected = sorted(sum(single.micro_batches(step), []))
        got = [i for s in shards for mb in s.micro_batches(step) for i in mb]
        assert all(len(mb) == dbs for s in shards for mb in s.micro_batches(step))
        assert sorted(got) == expected and len(set(got)) == batch
    assert sorted(sum(single.micro_batches(0), [])) != sorted(sum(single.micro_batches(12), []))


def test_too_little_data_for_one_batch():
    with pytest.raises(InputError, match="fewer than one global batch"):
        GlobalBatchLoader(5, BatchPlan.make(8, 1, None), 0, 0)


def test_micro_batches_grouped_by_length_keep_the_examples_and_sizes():
    """by_length (the RM trainer's accumulation): the same examples in micro-batches of the same sizes,
    shortest together, so each pads to little more than its own."""
    lengths = {i: (i * 37) % 11 for i in range(12)}
    micro = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    grouped = by_length(micro, lengths.__getitem__)
    assert [len(mb) for mb in grouped] == [4, 4, 4] and sorted(sum(grouped, [])) == list(range(12))
    longest = [max(lengths[i] for i in mb) for mb in grouped]
    assert longest == sorted(longest) and sum(longest) < sum(max(lengths[i] for i in mb) for mb in micro)
    pair = TokenizedPair([1, 2, 3, 4, 5], [1, 2, 3, 9], 1.0)
    assert pair.row_length == 3 + 2 + 1 and collate_pairs([pair], 0)["input_ids"].tolist() == [[1, 2, 3, 4, 5, 9]]
