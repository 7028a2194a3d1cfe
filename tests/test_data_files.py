"""Parquet, Arrow and `datasets` save_to_disk inputs, written by the datasets library itself
(tests/fixtures/datasets/make_fixtures.py): the same rows as the equivalent JSONL, the same trained weights, and a
bad row named by its row number and field."""
from __future__ import annotations

import pytest
import torch
from conftest import REPO

from nanochat_ext.data.rows import load_pairs, load_prompts
from nanochat_ext.errors import InputError
from nanochat_ext.runtime.checkpoint import find_checkpoint, torch_load
from scripts import kat_train_rm

FIX = REPO / "tests" / "fixtures" / "datasets"
TABLES = [FIX / "pairs.parquet", FIX / "pairs", FIX / "pairs" / "data-00000-of-00001.arrow"]


@pytest.mark.parametrize("table", TABLES, ids=["parquet", "save_to_disk", "arrow"])
def test_a_table_gives_the_jsonls_pairs(table):
    want, _ = load_pairs(FIX / "pairs.jsonl")
    got, skipped = load_pairs(table)
    assert skipped == 0 and len(got) == 16
    assert got == want  # every field: messages, answers, the weights of even rows (null: 1), prefix ids, numbers
    assert {r.weight for r in got[1::2]} == {1.0} and got[2].weight == 2.5


def test_chat_prompts_in_parquet_are_the_jsonls():
    want, got = load_prompts(FIX / "prompts_chat.jsonl"), load_prompts(FIX / "prompts_chat.parquet")
    assert [(r.messages, r.prefix_id, r.row, r.line) for r in got] == [(r.messages, r.prefix_id, r.row, r.line)
                                                                       for r in want]


def test_a_bad_row_is_named_by_its_row_number_and_field():
    with pytest.raises(InputError) as e:
        load_pairs(FIX / "bad.parquet")
    assert str(e.value) == f"{FIX / 'bad.parquet'}: row 3: field 'chosen': missing"
    rows, skipped = load_pairs(FIX / "bad.parquet", skip_bad=True)
    assert skipped == 1 and len(rows) == 4


def test_a_dataset_dict_a_broken_file_and_a_wrong_kind_each_end_in_one_line(tmp_path):
    with pytest.raises(InputError, match=r"a DatasetDict: give one split's directory \(train, test\)"):
        load_pairs(FIX / "splits")
    assert len(load_pairs(FIX / "splits" / "train")[0]) == 12
    cut = tmp_path / "cut.parquet"
    cut.write_bytes((FIX / "pairs.parquet").read_bytes()[:1000])
    jsonl_named_arrow = tmp_path / "pairs.arrow"
    jsonl_named_arrow.write_bytes((FIX / "pairs.jsonl").read_bytes())
    for path, kind in ((cut, "parquet"), (jsonl_named_arrow, "arrow")):
        with pytest.raises(InputError, match=f"not a readable {kind} file") as e:
            load_pairs(path)
        assert len(str(e.value).splitlines()) == 1


def test_training_on_parquet_gives_the_jsonls_weights(assets, tmp_path):
    weights = []
    for data in (FIX / "pairs.jsonl", FIX / "pairs.parquet"):
        out = tmp_path / data.suffix.lstrip(".")
        assert kat_train_rm.main(["--backbone", str(assets["gpt"]), "--pairs", str(data), "--max_steps", "2",
                                  "--batch_size", "4", "--max_len", "64", "--unfreeze_last", "1", "--val_ratio", "0",
                                  "--device", "cpu", "--out", str(out)]) == 0
        weights.append(torch_load(find_checkpoint(out)[0], "checkpoint"))
    assert weights[0].keys() == weights[1].keys()
    for name, w in weights[0].items():
        torch.testing.assert_close(weights[1][name], w, atol=0, rtol=0, msg=name)
