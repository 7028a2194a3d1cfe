"""engine/scheduler.py on its own, no model: how many rows a step runs as rows stop (eager keeps the live rows once a
quarter stopped; compiled halves into the kept states the memory model counts), how much cache a compiled step reads,
and LiveRows writing each leaving row back where the call has it."""
from __future__ import annotations

import torch

from nanochat_ext.engine import scheduler
from nanochat_ext.engine.forcing import ToolState
from nanochat_ext.engine.scheduler import LiveRows, compaction_sizes, read_length, shrunk_rows


def test_eager_keeps_the_live_rows_once_a_quarter_have_stopped():
    assert [shrunk_rows(12, live, static=False) for live in (12, 10, 9, 8, 1)] == [12, 12, 9, 8, 1]
    assert shrunk_rows(3, 2, static=False) == 2  # a third stopped: over the quarter


def test_compiled_halves_while_the_live_rows_fit_and_only_into_states_it_keeps():
    assert scheduler.COMPACT_MIN_ROWS == 8
    assert [shrunk_rows(64, live, static=True) for live in (64, 33, 32, 17, 16, 9, 8, 1)] == \
        [64, 64, 32, 32, 16, 16, 8, 8]  # never below COMPACT_MIN_ROWS
    assert shrunk_rows(24, 5, static=True) == 12 and shrunk_rows(12, 5, static=True) == 12  # 6 < 8: stays
    assert shrunk_rows(9, 1, static=True) == 9  # an odd count has no half
    for rows in (64, 48, 24, 16, 9):  # every count a call can reach is one the engine keeps a state for
        reached = {shrunk_rows(r, live, static=True) for r in [rows, *compaction_sizes(rows)] for live in range(r + 1)}
        assert reached <= {rows, *compaction_sizes(rows)}, rows
    assert compaction_sizes(64) == [32, 16, 8] and compaction_sizes(9) == []


def test_a_compiled_step_reads_the_slots_in_use_by_doubling_buckets():
    bucket = scheduler.READ_BUCKET
    assert [read_length(used, 8 * bucket) for used in (1, bucket, bucket + 1, 3 * bucket, 5 * bucket)] == \
        [bucket, bucket, 2 * bucket, 4 * bucket, None]  # None: the whole cache (its own graph)
    assert read_length(bucket + 1, 2 * bucket) is None


def test_rows_leaving_the_batch_are_written_back_where_the_call_has_them():
    """Two shrinks (rows 1 and 3 stop, then row 4 of the call), then the end: every row's out, length, done flag,
    log-probs and sampled marks are in the call's order, and `of` maps the batch's rows to the call's."""
    rows, width = 5, 4
    out = torch.arange(rows * width).view(rows, width)
    lengths, done = torch.full((rows,), width), torch.zeros(rows, dtype=torch.bool)
    logps, tools = torch.zeros(rows, width), ToolState.empty(rows, width, torch.device("cpu"))
    batch = LiveRows(out, lengths, done, logps, tools)  # the call's own tensors, as the runner starts with them

    done[[1, 3]], lengths[[1, 3]], out[[1, 3], 1] = True, 2, -1
    keep = batch.shrink(out, lengths, done, logps, tools)
    assert keep.tolist() == [0, 2, 4] and batch.held == 3 and batch.of([1, 2]) == [2, 4]
    out, lengths, done, logps, tools = out[keep], lengths[keep], done[keep], logps[keep], tools.select(keep)

    done[2], lengths[2], logps[2] = True, 3, 0.5  # the call's row 4
    tools.sampled[2, 0] = False
    keep = batch.shrink(out, lengths, done, logps, tools)
    assert keep.tolist() == [0, 1] and batch.of([0, 1]) == [0, 2]
    out, lengths, done, logps, tools = out[keep], lengths[keep], done[keep], logps[keep], tools.select(keep)

    done[:] = True
    lengths[:] = torch.tensor([4, 1])
    got_out, got_lengths, got_done, got_logps, got_tools = batch.whole(out, lengths, done, logps, tools)
    assert got_lengths.tolist() == [4, 2, 1, 2, 3] and got_done.all()
    assert got_out[:, 1].tolist() == [1, -1, 9, -1, 17]
    assert got_logps[4].tolist() == [0.5] * width and got_logps[:4].abs().sum() == 0
    assert got_tools.sampled[:, 0].tolist() == [True, True, True, True, False]
