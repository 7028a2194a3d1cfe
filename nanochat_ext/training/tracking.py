"""Rank-0 outputs of a run: a metrics.jsonl, the same scalars in TensorBoard and/or wandb (--report_to), one-line
greppable log lines and a progress bar. Other ranks get a Tracker that does nothing, so call sites need no rank
checks. A wandb run's id is kept in <log_dir>/wandb_run_id, so a resumed run continues the same wandb run.

A run that starts at step S (a resume, or 0) first drops every record past S that an interrupted
run left in metrics.jsonl, rollouts.jsonl and TensorBoard, so no step is logged twice."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import uuid
from pathlib import Path

import torch

from nanochat_ext.ddp_common import all_reduce_sum, raise_if_any
from nanochat_ext.errors import InputError, first_line
from nanochat_ext.models.compiled import CompileLog, compile_stats
from nanochat_ext.runtime import console

JSONL_LOGS = ("metrics.jsonl", "rollouts.jsonl")


REPORT_TARGETS = ("tensorboard", "wandb", "none")


def report_targets(value: str) -> list[str]:
    """--report_to as a list of targets ('none': none), or one line for an unknown target or a wandb that is not
    installed."""
    targets = [t.strip() for t in value.split(",") if t.strip()]
    unknown = [t for t in targets if t not in REPORT_TARGETS]
    if unknown or not targets or ("none" in targets and len(targets) > 1):
        raise InputError(f"--report_to must be tensorboard, wandb, both comma-separated, or none; got {value!r}")
    if "wandb" in targets and importlib.util.find_spec("wandb") is None:
        raise InputError("--report_to wandb: the wandb library is not installed here (pip install wandb==0.31.0)")
    return [t for t in targets if t != "none"]


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (its stderr is no terminal, yet a person watches the cell): IPython's
    kernel shell or a subclass of it (Colab's)."""
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    return any(c.__name__ == "ZMQInteractiveShell" for c in type(shell).__mro__) or "google.colab" in sys.modules


class Tracker:
    def __init__(self, log_dir: str | Path | None, enabled: bool, total_steps: int, start_step: int, name: str,
                 report_to: str = "tensorboard", config: dict | None = None, project: str | None = None):
        self.enabled, self.name = enabled, name
        self.writer = self.metrics_file = self.bar = self.wandb = None
        self.compiles = CompileLog()  # --compile: each compile and recompile, printed at the next log
        self.t0 = time.time()
        failure = None
        try:
            if enabled:
                self._open(log_dir, total_steps, start_step, report_to, config, project)
        except Exception as e:  # wandb's init (a login, a run id it refuses): one line, on every rank
            failure = f"--report_to wandb: wandb did not start ({first_line(e)})"
        raise_if_any(failure)

    def _open(self, log_dir, total_steps: int, start_step: int, report_to: str, config: dict | None,
              project: str | None) -> None:
        name = self.name
        targets = report_targets(report_to)
        if log_dir is not None:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            for jsonl in JSONL_LOGS:
                drop_records_after(Path(log_dir) / jsonl, start_step)
            if "tensorboard" in targets:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(log_dir), purge_step=start_step + 1)
            self.metrics_file = open(Path(log_dir) / "metrics.jsonl", "a")
            if "wandb" in targets:
                self.wandb = start_wandb(Path(log_dir), name, config or {}, project, resumed=start_step > 0)
        if sys.stderr.isatty() or in_notebook():  # a person watches: step N/M, its rate, the time left
            from tqdm.auto import tqdm  # a notebook's widget where ipywidgets is installed, else text

            self.bar = tqdm(total=total_steps, initial=start_step, desc=name, dynamic_ncols=True,
                            file=console.terminal())
            console.show_bar(self.bar)  # the run's other lines are written around it

    def log(self, step: int, metrics: dict[str, float], shown: tuple[str, ...] | None = None,
            echo: bool = True) -> None:
        """Record already-reduced metrics for `step`; echo prints one `name step N | k v | ...` line of the metrics
        `shown` (None: all). Once anything is compiled (--compile), rank 0's graph count and compile seconds so far
        ride along in the logs (and in a full line), and a line for each compile since the last log says which
        function compiled and why (CompileLog)."""
        if not self.enabled:
            return
        graphs, seconds = compile_stats()
        if graphs:
            metrics = {**metrics, "perf/compiled_graphs": graphs, "perf/compile_s_total": seconds}
            for line in self.compiles.new_lines():
                self._print(line)
        if self.writer is not None:
            for k, v in metrics.items():
                self.writer.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if self.metrics_file is not None:
            self.metrics_file.write(json.dumps({"step": step, **metrics}) + "\n")
            self.metrics_file.flush()
        if echo:
            line = " | ".join(f"{k} {metrics[k]:.4g}" for k in (metrics if shown is None else shown) if k in metrics)
            self._print(f"{self.name} step {step} | {line}")

    def _print(self, msg: str) -> None:
        print(msg, flush=True)  # beside the bar: runtime/console.py writes lines around it

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def records(self, filename: str, rows: list[dict]) -> None:
        """Append rows as JSON lines to <log_dir>/<filename> (e.g. every rollout of a step)."""
        if self.metrics_file is None:
            return
        with open(Path(self.metrics_file.name).parent / filename, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)

    def text(self, step: int, tag: str, text: str) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, text, step)

    def close(self) -> None:
        graphs, seconds = compile_stats() if self.enabled else (0, 0.0)
        if graphs:
            for line in self.compiles.new_lines():
                self._print(line)
            print(f"compile: {graphs} graphs, {seconds:.1f} s", flush=True)
        if self.bar is not None:
            console.show_bar(None)
            self.bar.close()
        if self.writer is not None:
            self.writer.close()
        if self.metrics_file is not None:
            self.metrics_file.close()
        if self.wandb is not None:
            self.wandb.finish()
        self.bar = self.writer = self.metrics_file = self.wandb = None


def start_wandb(log_dir: Path, name: str, config: dict, project: str | None, resumed: bool):
    """A wandb run writing under log_dir ($WANDB_DIR where set, as wandb itself honours it), the run's flags as its
    config. The id of the run it started is kept in
    log_dir/wandb_run_id once wandb has started, and a resumed run (resumed: from a checkpoint) continues that run;
    a fresh one gets a new id. wandb keeps what an interrupted run logged past the checkpoint and ignores the
    resumed run's steps it already has (metrics.jsonl and TensorBoard drop and rewrite them)."""
    import wandb

    id_file = log_dir / "wandb_run_id"
    run_id = id_file.read_text().strip() if resumed and id_file.is_file() else uuid.uuid4().hex[:8]
    run = wandb.init(project=project or os.environ.get("WANDB_PROJECT") or "nanochat_ext", id=run_id, resume="allow",
                     name=f"{name}-{log_dir.parent.name}", dir=os.environ.get("WANDB_DIR") or str(log_dir),
                     config=config, job_type=name)
    id_file.write_text(run.id + "\n")
    return run


def drop_records_after(path: Path, step: int) -> None:
    """Rewrite a JSONL log without the records whose "step" is past `step` (atomically)."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
    keep = [line for line in lines if _step_of(line) <= step]
    if len(keep) == len(lines):
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(keep), encoding="utf-8")
    os.replace(tmp, path)


def _step_of(line: str) -> float:
    try:
        return float(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):  # a torn last line from a crash: drop it
        return float("inf")


class WindowSums:
    """Named float64 sums over the steps of one logging window on this rank; `reduced` sums them over
    all ranks in one all-reduce (collective)."""

    def __init__(self, names: list[str]):
        self.names = list(names)
        self.index = {n: i for i, n in enumerate(self.names)}
        self.sums = torch.zeros(len(self.names), dtype=torch.float64)

    def add(self, **values: float) -> None:
        for name, value in values.items():
            self.sums[self.index[name]] += float(value)

    def reduced(self) -> dict[str, float]:
        return dict(zip(self.names, all_reduce_sum(self.sums.clone()).tolist()))

    def zero(self) -> None:
        self.sums.zero_()
