"""What every script's command line shares: dashed flag aliases and the run wrapper that turns
bad input into one clear line and a non-zero exit on every rank."""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

from nanochat_ext.data.batching import LONG_PAIRS
from nanochat_ext.ddp_common import DistEnv, detect_launcher, dist_session, previous_ending, print0, remember_ending
from nanochat_ext.errors import InputError, first_line
from nanochat_ext.models.reward_model import WEIGHT_MODES
from nanochat_ext.models.vintages import NANOCHAT_WRITTEN, VINTAGE_FLAG
from nanochat_ext.runtime.checkpoint import base_dir
from nanochat_ext.runtime.guard import (EXIT_INTERRUPTED, EXIT_NONFINITE, Interrupted, NonFiniteError,
                                        restore_signal_handlers)
from nanochat_ext.runtime.outdir import KEEP_LAST_HELP, release_out_dirs
from nanochat_ext.runtime.parallel import PARALLEL_MODES
from nanochat_ext.runtime.peers import (EXIT_LOST_RANK, PROGRESS, failed_ranks, lost_rank_line, missing_ranks,
                                        says_the_line)
from nanochat_ext.runtime.resume import RESUME_HELP
from nanochat_ext.training.memory import EXIT_OUT_OF_MEMORY, is_out_of_memory, out_of_memory_line
from nanochat_ext.training.tracking import report_targets

EXIT_BAD_INPUT = 2


def add_dashed_aliases(parser: argparse.ArgumentParser) -> None:
    """Accept --max-steps wherever --max_steps is defined (the underscore spelling is canonical)."""
    for action in parser._actions:
        for flag in list(action.option_strings):
            if flag.startswith("--") and "_" in flag:
                alias = flag.replace("_", "-")
                action.option_strings.append(alias)
                parser._option_string_actions[alias] = action


def add_output_args(parser: argparse.ArgumentParser, stage_dir: str,
                    tag_help: str = "'density' with --density, else 'uniform'") -> None:
    """--out/--tag/--save_every/--resume/--log_dir, shared by the training scripts."""
    g = parser.add_argument_group("outputs")
    g.add_argument("--out", default=None, help=f"checkpoint dir (default: $NANOCHAT_BASE_DIR/{stage_dir}/<tag>)")
    g.add_argument("--tag", default=None, help=f"output tag (default: {tag_help})")
    g.add_argument("--save_every", type=int, default=0, help="also checkpoint every N steps (0: only at the end)")
    g.add_argument("--keep_last", type=int, default=2, metavar="N", help=KEEP_LAST_HELP)
    g.add_argument("--resume", default=None, help=RESUME_HELP)
    g.add_argument("--resume_extend", action="store_true",
                   help="let --resume change --max_steps, --lr or --warmup_steps (the schedule is recomputed from "
                        "the new values; without this flag a changed schedule is refused)")
    g.add_argument("--skip_nonfinite", type=int, default=0,
                   help="skip up to N steps whose loss or gradient is NaN/inf, logged (default 0: stop at the first, "
                        "with nothing saved)")
    g.add_argument("--log_dir", default=None, help="TensorBoard + metrics.jsonl dir (default: <out>/logs)")
    g.add_argument("--report_to", default="tensorboard",
                   help="where rank 0 sends the scalars besides <log_dir>/metrics.jsonl: tensorboard, wandb (the "
                        "wandb library, installed apart; WANDB_MODE=offline works), both as 'tensorboard,wandb', or "
                        "none (default: %(default)s)")
    g.add_argument("--wandb_project", default=None, help="wandb project (default: $WANDB_PROJECT, else nanochat_ext)")
    g.add_argument("--consolidate", default=None, metavar="DIR",
                   help="with --resume: write the checkpoint resumed from (a sharded one too) whole, in the input's own "
                        "layout, into DIR, and stop without training")


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    """--parallel and --activation_checkpointing, for the scripts that train (parallel.py)."""
    g = parser.add_argument_group("memory")
    g.add_argument("--parallel", choices=PARALLEL_MODES, default="ddp",
                   help="ddp: every rank holds the whole trained model, gradients and optimizer state; fsdp: each rank "
                        "holds 1/N of them (PyTorch FSDP2), checkpoints while training are sharded and the final one is "
                        "also written whole (one rank under torchrun is fine) (default: %(default)s)")
    g.add_argument("--activation_checkpointing", action="store_true",
                   help="keep only each transformer block's input for the backward pass and recompute the rest there: "
                        "less memory for about one more forward pass, the same gradients")


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    """--lora_r, --lora_alpha, --lora_dropout, --lora_targets and --merge_lora (lora.py), for the RM, GRPO and DPO."""
    g = parser.add_argument_group("LoRA (peft)")
    g.add_argument("--lora_r", type=int, default=0,
                   help="train LoRA adapters of this rank (peft) instead of the weights: no gradients or optimizer "
                        "state for the base, and GRPO's and DPO's reference is the base with the adapters off, no second copy "
                        "(default 0: no LoRA)")
    g.add_argument("--lora_alpha", type=float, default=None, help="LoRA's alpha: updates scaled by alpha / r "
                                                                  "(default: 2 x --lora_r)")
    g.add_argument("--lora_dropout", type=float, default=None, help="dropout on the adapters' input while training "
                                                                    "(default: 0)")
    g.add_argument("--lora_targets", default=None,
                   help="comma-separated module names to adapt (default: every linear layer of the transformer blocks: "
                        "nanochat's c_q,c_k,c_v,c_proj,c_fc; our Llama's fused qkv,o,gate_up,down; peft's 'all-linear' "
                        "for other transformers models)")
    g.add_argument("--merge_lora", action="store_true",
                   help="write the final checkpoint with the adapters merged into the base, in the input's own layout "
                        "(nanochat model_<N>.pt, an HF dir, an RM checkpoint), which nanochat and every stage load; "
                        "without it checkpoints hold the adapters (peft's adapter dir)")


def add_pairs_args(parser: argparse.ArgumentParser, model: str) -> None:
    """The flags of a trainer on preference pairs (kat_train_rm, kat_train_dpo; `model`: what it trains): the pairs,
    their weights and how the loss uses them, how a pair is cut to fit, the share held out."""
    g = parser.add_argument_group("pairs")
    g.add_argument("--pairs", required=True, help="preference pairs: JSONL, parquet, Arrow or a datasets save_to_disk dir "
                                                  "(formats: README.md, \"Data formats\")")
    g.add_argument("--density", default=None,
                   help="density weights: JSONL {prefix_id, weight}, or the fork's prefixes_all.jsonl + "
                        "density_weights.npy (either file or their dir). Rare prompts should carry larger weights")
    g.add_argument("--skip_bad_rows", action="store_true",
                   help="skip malformed pair rows (and report how many) instead of stopping at the first")
    g.add_argument("--weight_mode", choices=WEIGHT_MODES, default="mean",
                   help="mean: sum(w*loss)/sum(w) over the global batch; sum: sum(w*loss)/n_pairs (weights keep "
                        "their scale); none: ignore weights (default: %(default)s)")
    g.add_argument("--weight_cap", type=float, default=None, help="clip each pair's weight to at most this")
    g.add_argument("--max_len", type=int, default=None,
                   help="tokens per sequence; prompts are cut from the left, responses from the right "
                        f"(default: the {model}'s context, at most 1024)")
    g.add_argument("--long_pairs", choices=LONG_PAIRS, default="truncate",
                   help="a pair longer than --max_len: truncate (both sides keep the same prompt window, the "
                        "responses are cut from the right) or drop it, as TRL does (default: %(default)s)")
    g.add_argument("--val_ratio", type=float, default=0.1,
                   help="share of prompts (by prefix_id) held out for validation (default: %(default)s)")


MODEL_HELP = ("a nanochat checkpoint: a dir (its largest model_<N>.pt with meta_<N>.json; nanochat's zero-padded "
              "steps or our stamps), a model_<N>.pt file, a checkpoints root such as chatsft_checkpoints/ (its "
              "largest d<N> tag), or base|sft|rl[:tag] under $NANOCHAT_BASE_DIR (e.g. sft:d20); or a local "
              "Hugging Face causal-LM dir")


def add_runtime_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("runtime")
    g.add_argument(VINTAGE_FLAG, default=None, choices=NANOCHAT_WRITTEN,
                   help="which nanochat wrote the checkpoint, when its keys cannot tell (only the softcap-20 week "
                        "of March 2026 needs it: feb2026 vs mar2026a); default: read from the checkpoint")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    g.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="auto: bf16 autocast on CUDA, fp32 on CPU")
    g.add_argument("--backend", default=None, help="process-group backend (default: nccl on CUDA, gloo on CPU). Given explicitly, a one-process "
                        "run creates the group too, so one GPU runs the whole distributed path")
    g.add_argument("--dist_timeout", type=float, default=1800.0, help="collective timeout, seconds")
    g.add_argument("--compile", choices=("auto", "0", "1"), default="auto",
                   help="1: torch.compile each transformer block of our models (nanochat GPT, native Llama) wherever "
                        "they train or score, and the LM head's log-prob chain; the log says how many graphs and seconds that took. GRPO also decodes "
                        "with a compiled static-shape step, sampling included (the same tokens as eager; ~10-19 s to "
                        "compile on a 2-core CPU, then ~1.6x faster there). auto: blocks compiled on CUDA, eager on "
                        "CPU; GRPO's decode step compiled on CPU when --max_steps x --max_new_tokens >= 100000, "
                        "eager on CUDA, where it is not yet measured (default: %(default)s)")


def output_dirs(args: argparse.Namespace, stage_dir: str, default_tag: str | None = None) -> tuple[Path, Path]:
    """(checkpoint dir, log dir): --out, else $NANOCHAT_BASE_DIR/<stage_dir>/<tag>; the tag defaults to
    default_tag, else 'density' or 'uniform' by whether --density was given."""
    tag = args.tag or default_tag or ("density" if getattr(args, "density", None) else "uniform")
    out_dir = Path(args.out) if args.out else base_dir() / stage_dir / tag
    return out_dir, Path(args.log_dir) if args.log_dir else out_dir / "logs"


def script_argv(argv: list[str] | None) -> list[str]:
    """The script's own arguments; drops the `--` that `torchrun ... -m scripts.X -- ...` passes on."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return argv[1:] if argv[:1] == ["--"] else argv


# Endings a restart would meet again (torchrun restarts after any failure): the next start ends at once with the line.
ENDINGS_THAT_REPEAT = (EXIT_BAD_INPUT, EXIT_NONFINITE, EXIT_OUT_OF_MEMORY)


def run_script(args: argparse.Namespace, body: Callable[[argparse.Namespace, DistEnv], Path], label: str) -> int:
    """Run body(args, env) inside a process-group session that is always torn down; rank 0 prints
    `<label>: <path returned>` as the last line. A failure ends with one `error: ...` line, the last on
    stderr (of rank 0 for an error every rank shares, else of each failing rank), and an exit code:
    EXIT_BAD_INPUT for bad input, EXIT_NONFINITE, EXIT_INTERRUPTED (SIGTERM/SIGINT, checkpointed),
    EXIT_OUT_OF_MEMORY (one line on every rank that ran out, saying what to change), EXIT_LOST_RANK (a rank stopped
    answering: one line naming it) or 1 for anything unforeseen (after its traceback). Under torchrun a start that
    follows one ending in ENDINGS_THAT_REPEAT ends at once with that line."""
    rank = detect_launcher()[1]
    timeout = datetime.timedelta(seconds=args.dist_timeout)
    PROGRESS.clear()

    def end(code: int, message: str, everyone: bool = False, said: bool = True, again: str = "") -> int:
        """The line (with `again` said after it), printed by rank 0 (or by every rank, or by none where another says
        it), on every rank into torchrun's summary, and kept for torchrun's next start where it would end so again."""
        record_for_torchrun(f"error: {message}{again}")
        if code in ENDINGS_THAT_REPEAT:
            remember_ending(code, message, timeout)
        if said and (rank == 0 or everyone):
            say(f"error: {message}{again}")
        return code

    if (ended := previous_ending(timeout)) is not None:
        return end(*ended, again=" (torchrun's previous start ended so; not run again)")
    try:
        group = getattr(args, "parallel", "ddp") == "fsdp"  # FSDP shards over a process group, even of one rank
        with dist_session(args.device, args.backend, args.dist_timeout, group) as env:
            result = body(args, env)
            if env.is_main:
                print(f"{label}: {result}", flush=True)
        return 0
    except InputError as e:
        return end(EXIT_BAD_INPUT, str(e), everyone=not e.collective)
    except NonFiniteError as e:
        return end(EXIT_NONFINITE, str(e))
    except Interrupted as e:
        if rank == 0:
            say(str(e))
        return EXIT_INTERRUPTED
    except Exception as e:  # a bug or an environment failure: its traceback, then the one line
        if is_out_of_memory(e):  # bad input too (a model or batch too big): every rank that hit it says so
            return end(EXIT_OUT_OF_MEMORY, out_of_memory_line(e, args), everyone=True)
        if missing_ranks(e):  # a peer stopped answering: one line from the lowest rank that still does
            return end(EXIT_LOST_RANK, lost_rank_line(e, args.dist_timeout), everyone=True, said=says_the_line(e, rank))
        if failed_ranks(e):  # a peer ended with an error of its own, and says its line
            return end(EXIT_LOST_RANK, f"rank {failed_ranks(e)[0]} ended with its own error", said=False)
        traceback.print_exc()
        return end(1, first_line(e, 300), everyone=True)
    finally:
        release_out_dirs()
        restore_signal_handlers()


def say(line: str) -> None:
    """One line on stderr in one write: ranks that share torchrun's stderr pipe then cannot interleave inside it (a
    pipe's writes of up to PIPE_BUF bytes are atomic), as print's text and newline could (seen: two ranks' lines run
    together). A stderr with no file descriptor (pytest's capsys) takes it as one write call."""
    sys.stderr.flush()
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        return
    os.write(fd, (line + "\n").encode())


def record_for_torchrun(line: str) -> None:
    """Under torchrun, the line goes into the error file its agent gives each worker (TORCHELASTIC_ERROR_FILE), in the
    layout of torch's own @record (errors.ErrorHandler): its failure summary then shows the line where it would show
    `<N/A>`."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            with open(path, "w") as f:
                json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                      "timestamp": str(int(time.time()))}}}, f)
        except OSError:
            pass  # the summary then says <N/A>; the line itself is printed all the same


def run_plain(body: Callable[[], object], label: str) -> int:
    """run_script for a script without a process group (one process, no training loop): prints
    `<label>: <result>` on success, or one `error: ...` line and returns EXIT_BAD_INPUT on bad input."""
    try:
        result = body()
    except InputError as e:
        say(f"error: {e}")
        return EXIT_BAD_INPUT
    print(f"{label}: {result}", flush=True)
    return 0


# flag -> (test, what it must be): checked by check_flags before anything is loaded.
COMMON_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "max_steps": (lambda v: v >= 1, ">= 1"),
    "num_epochs": (lambda v: v >= 1, ">= 1"),
    "lr": (lambda v: math.isfinite(v) and v > 0, "a finite number > 0"),
    "warmup_steps": (lambda v: v >= 0, ">= 0"),
    "weight_decay": (lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0"),
    "grad_clip": (lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0 (0: off)"),
    "log_every": (lambda v: v >= 0, ">= 0 (0: only at the end)"),
    "eval_every": (lambda v: v >= 0, ">= 0 (0: only at the end)"),
    "save_every": (lambda v: v >= 0, ">= 0 (0: only at the end)"),
    "keep_last": (lambda v: v >= 0, ">= 0 (0: keep every checkpoint)"),
    "skip_nonfinite": (lambda v: v >= 0, ">= 0"),
    "dist_timeout": (lambda v: math.isfinite(v) and v > 0, "a finite number of seconds > 0"),
    "val_ratio": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "max_len": (lambda v: v >= 3, ">= 3 (BOS, a prompt token and a response token)"),
}


def check_flags(args: argparse.Namespace, ranges: dict[str, tuple[Callable[[float], bool], str]] | None = None) -> None:
    """Every numeric flag in its range, before the first step: one line naming the flag otherwise."""
    for name, (ok, want) in {**COMMON_RANGES, **(ranges or {})}.items():
        value = getattr(args, name, None)
        if value is not None and not ok(value):
            raise InputError(f"--{name} must be {want}, got {value!r}")
    if getattr(args, "report_to", None) is not None:
        report_targets(args.report_to)


DEFAULT_MAX_STEPS = 100


def steps_from_epochs(args: argparse.Namespace, n_train: int, per_step: int, unit: str = "prompts") -> int:
    """Set --max_steps where it is not given: n_train // per_step x --num_epochs (nanochat's chat_rl counts its steps
    so; the lr schedule and the evaluation cadence follow), else DEFAULT_MAX_STEPS. With --num_epochs, rank 0 prints
    the line saying which. `unit`: what is counted (prompts, pairs). Returns --max_steps."""
    epochs = getattr(args, "num_epochs", None)
    if not epochs:
        args.max_steps = args.max_steps or DEFAULT_MAX_STEPS
    elif args.max_steps is not None:
        print0(f"max_steps: {args.max_steps} as given (--num_epochs {epochs} not used)")
    elif n_train < per_step:
        raise InputError(f"--num_epochs {epochs}: {n_train} train {unit} make no step of {per_step}; give fewer per "
                         f"step (--batch_size), more {unit}, or --max_steps")
    else:
        args.max_steps = n_train // per_step * epochs
        print0(f"max_steps: {args.max_steps} = {n_train} train {unit} // {per_step} per step x {epochs} epochs")
    return args.max_steps


def micro_batch(value: str) -> int | str:
    """--device_batch_size: a positive number, or 'auto'."""
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a number >= 1 or 'auto', got {value!r}")
    return n


def auto_micro_batch(args: argparse.Namespace, device) -> bool:
    """Whether --device_batch_size is to be picked by memory: 'auto', or not given on CUDA."""
    return args.device_batch_size == "auto" or (args.device_batch_size is None and device.type == "cuda")


MICRO_BATCH_HELP = ("per forward on each rank; gradient accumulation makes up the rest. 'auto' (the default on CUDA): "
                    "the largest that divides the rank's share and fits the free memory by the memory model, the same "
                    "on every rank (logged with its figures). Default on CPU: the rank's whole share")


def check_consolidate(args: argparse.Namespace) -> None:
    """--consolidate writes the checkpoint --resume names: one line when there is none to write."""
    if getattr(args, "consolidate", None) and args.resume is None:
        raise InputError("--consolidate DIR writes a checkpoint whole: give the one to write with --resume")


def given_flags(p: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The dests of the flags argv gives explicitly, whatever their values (a preset leaves those alone)."""
    quiet = copy.deepcopy(p)
    for action in quiet._actions:
        action.default, action.required = argparse.SUPPRESS, False
    return set(vars(quiet.parse_known_args(argv)[0]))
