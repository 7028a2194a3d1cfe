"""--report_to: the scalars go to wandb (offline here) as to metrics.jsonl, a resumed run continues the same wandb
run, and a target that is not there is one line before anything is written."""
from __future__ import annotations

import json
import sys
import types

import pytest
from conftest import run_script
from test_reliability import rm_args

from nanochat_ext.training.tracking import Tracker, in_notebook
from scripts import kat_train_rm


def wandb_history(run_file) -> dict[int, dict]:
    """The history rows of an offline wandb run: {step: {key: value}}. The .wandb file is a LevelDB-style log (a
    7-byte ':W&B' header, then 32 KiB blocks of chunks, each with a 7-byte header: crc, length, type full / first /
    middle / last) of wandb's own protobuf Records, decoded with wandb's own classes."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending, rows = 7, b"", {}
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:  # zero padding at the end
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                       for item in record.history.item}
                rows[row["_step"]] = row
    return rows


def test_wandb_holds_the_metrics_and_a_resume_continues_its_run(assets, tmp_path):
    out = tmp_path / "rm"
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    args = rm_args(assets, out, "--max_steps", "4", "--save_every", "2", "--report_to", "tensorboard,wandb")
    proc = run_script("scripts.kat_train_rm", args, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    logs = out / "logs"
    run_id = (logs / "wandb_run_id").read_text().strip()
    [run_file] = logs.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")
    history = wandb_history(run_file)
    metrics = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) >= 4 and any(list(logs.glob("events.out.tfevents.*")))
    for record in metrics:  # every scalar of every logged step, as metrics.jsonl has it
        row = history[record["step"]]
        for key, value in record.items():
            if key != "step":
                assert row[key] == pytest.approx(value, rel=1e-12), (record["step"], key)
    stamps = sorted(int(p.stem.split("_")[1]) for p in out.glob("model_*.pt"))
    for name in (f"model_{stamps[-1]}.pt", f"meta_{stamps[-1]}.json", f"state_{stamps[-1]}.pt"):
        (out / name).unlink()
    resumed = run_script("scripts.kat_train_rm", args + ["--resume", "latest"], env=env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert (logs / "wandb_run_id").read_text().strip() == run_id
    assert len(list(logs.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))) == 2  # the same run, resumed
    # a fresh run (from step 0) logging into the same dir is a run of its own, not a continuation
    fresh = rm_args(assets, tmp_path / "fresh", "--max_steps", "1", "--report_to", "wandb", "--log_dir", str(logs))
    assert run_script("scripts.kat_train_rm", fresh, env=env).returncode == 0
    assert (logs / "wandb_run_id").read_text().strip() != run_id


def test_wandb_dir_is_honoured(assets, tmp_path):
    """$WANDB_DIR, where set, is where the wandb run goes (wandb's own rule); the run id stays beside the logs."""
    out, elsewhere = tmp_path / "rm", tmp_path / "wandb_elsewhere"
    elsewhere.mkdir()
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(elsewhere)}
    proc = run_script("scripts.kat_train_rm", rm_args(assets, out, "--max_steps", "1", "--report_to", "wandb"), env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run_id = (out / "logs" / "wandb_run_id").read_text().strip()
    assert len(list(elsewhere.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))) == 1
    assert not (out / "logs" / "wandb").exists()


def test_an_unknown_target_or_a_missing_wandb_is_one_line(assets, tmp_path, capsys, monkeypatch):
    assert kat_train_rm.main(rm_args(assets, tmp_path / "a", "--max_steps", "1", "--report_to", "mlflow")) == 2
    assert "--report_to must be tensorboard, wandb, both comma-separated, or none; got 'mlflow'" \
        in capsys.readouterr().err
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert kat_train_rm.main(rm_args(assets, tmp_path / "b", "--max_steps", "1", "--report_to", "wandb")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "the wandb library is not installed here (pip install wandb==0.31.0)" in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert kat_train_rm.main(rm_args(assets, tmp_path / "c", "--max_steps", "1", "--report_to", "none")) == 0
    assert not list((tmp_path / "c" / "logs").glob("events.out.tfevents.*"))
    assert (tmp_path / "c" / "logs" / "metrics.jsonl").is_file()


def test_the_step_line_is_the_methods_headline_and_the_logs_keep_every_metric(assets, tmp_path, capsys):
    """#80 item 8: the line printed every --log_every steps shows the method's headline (rm: loss, accuracy, margin,
    pairs/s) and the lr, a few hundred characters at most; metrics.jsonl keeps every metric; --log_line full prints
    them all."""
    for line_kind in ("short", "full"):
        out = tmp_path / line_kind
        assert kat_train_rm.main(rm_args(assets, out, "--max_steps", "2", "--log_every", "1", "--log_line",
                                         line_kind)) == 0
        lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("rm step 1 |")]
        logged = json.loads((out / "logs" / "metrics.jsonl").read_text().splitlines()[0])
        shown = [part.rsplit(" ", 1)[0] for part in lines[0].split(" | ")[1:]]
        if line_kind == "short":
            assert shown == ["train/loss", "train/accuracy", "train/margin", "perf/pairs_per_s", "train/lr",
                             "perf/train_time_s"] and len(lines[0]) < 300, lines
            assert {"train/grad_norm", "perf/tokens_per_s"} <= logged.keys()
        else:
            assert shown == [k for k in logged if k != "step"], (shown, logged)


def test_a_notebook_gets_the_progress_bar_a_terminal_gets(tmp_path, monkeypatch, capsys):
    """A Jupyter kernel's stderr is no terminal, yet a person watches: the run's bar (step N/M, rate, time left)."""
    assert not in_notebook()
    assert Tracker(tmp_path / "plain", True, 3, 0, "rm").bar is None  # pytest's stderr: no terminal, no kernel

    class ZMQInteractiveShell:  # what IPython's get_ipython() returns inside a Jupyter kernel
        config: dict = {}

    class Shell(ZMQInteractiveShell):  # Colab's, a subclass of it
        pass

    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=Shell))
    tracker = Tracker(tmp_path / "kernel", True, 3, 1, "rm", report_to="none")
    assert in_notebook() and tracker.bar is not None
    tracker.advance()
    tracker.close()
    assert "2/3" in capsys.readouterr().err
