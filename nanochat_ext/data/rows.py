"""Records: preference pairs and prompts parsed and validated from JSONL (or a parquet or Arrow file,
or a `datasets` directory written by save_to_disk, read with pyarrow: the same records, a row each), weights
attached, split by prompt (SFT's conversations: conversations.py; tokenizing and batching: batching.py).

Formats accepted per record (docs/data.md): plain {prompt, chosen, rejected}; chat messages
{prompt: [messages], chosen: [messages] | str, rejected: ...}; implicit-prompt chat
{chosen: [messages], rejected: [messages]} (the shared leading turns are the prompt); HH-RLHF
transcripts {chosen: "\\n\\nHuman: ...\\n\\nAssistant: ...", rejected: ...}; the density fork's
{id, prefix: {messages}, chosen, rejected, src, prefix_id}. Optional per row: weight, prefix_id.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanochat_ext.config import option
from nanochat_ext.data.gsm8k import is_gsm8k_row
from nanochat_ext.errors import Index, InputError, Row, first_line, located
from nanochat_ext.runtime.checkpoint import read_json

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class DataConfig:
    """What weighs a prompt's share of the loss, what is held out, and how long a sequence may be."""
    density: str | None = option(None, "density weights, each prompt's share of the loss scaled by its weight: JSONL "
                                 "{prefix_id, weight}, or the fork's prefixes_all.jsonl + density_weights.npy (either "
                                 "file or their dir). Rare prompts should carry larger weights")
    val_ratio: float = option(0.1, "share of prompts (by prefix_id) held out for evaluation{val_ratio}", type=float,
                              check=(lambda v: 0 <= v < 1, "in [0, 1)"))
    max_len: int | None = option(None, "tokens per sequence; prompts are cut from the left, {responses} from the right "
                                 "(default: the {model}'s context{at_most})", type=int,
                                 check=(lambda v: v >= 3, ">= 3 (BOS, a prompt token and a response token)"))
_HH_TURN = re.compile(r"\n\n(Human|Assistant):")


@dataclass
class PairRow:
    prompt: list[dict]  # chat messages ending with a user turn
    chosen: str
    rejected: str
    weight: float
    prefix_id: str
    line: int


def prefix_id_of(messages: list[dict]) -> str:
    """The fork's rule: md5 over the whitespace-normalised first user message, first 16 hex chars."""
    first_user = next((m["content"] for m in messages if m["role"] == "user"), "")
    return hashlib.md5(" ".join(first_user.split()).encode("utf-8")).hexdigest()[:16]


def _lines(path: str | os.PathLike) -> Iterator[tuple[int, str]]:
    p = Path(path)
    if not p.is_file():
        raise InputError("file not found", path=str(p))
    with open(p, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(f"not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}); JSONL files must be "
                                 f"UTF-8 (a UTF-16 or binary file?)", path=str(p), line=lineno) from None
            if line.strip():
                yield lineno, line


def _json_object(line: str, path: str, lineno: int) -> dict:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        # json's msg can end mid-phrase ('Invalid control character at'): the column completes it
        hint = "; a tab or newline inside a string is written \\t or \\n" if "control character" in e.msg else ""
        raise InputError(f"not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno}{hint})", path=path,
                         line=lineno) from None
    if not isinstance(obj, dict):
        raise InputError("expected a JSON object", path=path, line=lineno)
    return obj


def read_rows(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each record: each non-blank line of JSONL, each row of a table (is_table);
    a missing file or a non-object line is an InputError."""
    for number, record in records(path):
        yield number, record()


TABLE_SUFFIXES = (".parquet", ".arrow")


def is_table(path: str | os.PathLike) -> bool:
    """A parquet or Arrow file, or a directory written by datasets' save_to_disk."""
    p = Path(path)
    return p.suffix.lower() in TABLE_SUFFIXES or (p.is_dir() and ((p / "state.json").is_file()
                                                                  or (p / "dataset_dict.json").is_file()))


class InMemoryRows:
    """Records given in Python (nanochat_ext.api): a list of dicts, a datasets.Dataset, any iterable of mappings, read
    as a file's rows are (null fields left out, as a table's); `name` stands for a path in messages ("prompts: a
    Dataset of 64 rows[3]: field 'prompt': missing") and in the run's recorded flags. prompts: rows of prompts, where
    a prompt given bare (a string, a list of messages) is the row {"prompt": it}."""

    def __init__(self, rows: Iterable[Mapping[str, Any]], name: str, prompts: bool = False):
        self.rows, self.name, self.prompts = rows, name, prompts

    def __str__(self) -> str:
        return self.name

    def record(self, i: int, row: object) -> dict:
        if self.prompts and isinstance(row, (str, list)):
            return {"prompt": row}
        if not isinstance(row, Mapping):
            raise InputError(f"expected a dict, got {type(row).__name__}", path=self.name, line=Index(i))
        return {k: v for k, v in row.items() if v is not None}


def records(path: str | os.PathLike | InMemoryRows) -> Iterator[tuple[int, Callable[[], dict]]]:
    """(number, a call that returns the object) of each record: a JSONL line (parsed when called, so a bad line
    can be skipped), a table's row (a Row number; null columns left out, as an absent field), or a row given in
    Python (an Index)."""
    if isinstance(path, InMemoryRows):
        for i, row in enumerate(path.rows):
            yield Index(i), lambda i=i, row=row: path.record(i, row)
        return
    if not is_table(path):
        for lineno, line in _lines(path):
            yield lineno, lambda line=line, lineno=lineno: _json_object(line, str(path), lineno)
        return
    rows = (row for batch in _read_table(Path(path)).to_batches() for row in batch.to_pylist())  # a batch at a time
    for i, row in enumerate(rows, 1):
        yield Row(i), lambda row=row: {k: v for k, v in row.items() if v is not None}


def _read_table(p: Path):
    """The pyarrow table of a parquet file, an Arrow file (IPC file or stream, as datasets writes), or a
    save_to_disk directory (its Arrow shards in order); one line for anything else."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if p.is_dir():
        if (p / "dataset_dict.json").is_file():
            splits = read_json(p / "dataset_dict.json", "dataset_dict.json")
            names = splits.get("splits") if isinstance(splits, dict) else None
            raise InputError(f"a DatasetDict: give one split's directory ({', '.join(map(str, names or []))})",
                             path=str(p))
        state = read_json(p / "state.json", "state.json")
        files = state.get("_data_files") if isinstance(state, dict) else None
        if not isinstance(files, list) or not files or not all(isinstance(f, dict) and "filename" in f for f in files):
            raise InputError("state.json lists no data files ('_data_files': [{filename}])", path=str(p / "state.json"))
        try:
            return pa.concat_tables([_read_table(p / f["filename"]) for f in files])
        except pa.ArrowInvalid as e:  # shards of different columns
            raise InputError(f"its shards do not make one table ({first_line(e)})", path=str(p)) from None
    if not p.is_file():
        raise InputError("file not found", path=str(p))
    try:
        if p.suffix.lower() == ".parquet":
            return pq.read_table(p)
        with pa.memory_map(str(p)) as source:
            try:
                return pa.ipc.open_file(source).read_all()
            except pa.ArrowInvalid:
                source.seek(0)
                return pa.ipc.open_stream(source).read_all()
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"not a readable {p.suffix[1:]} file ({first_line(e)})", path=str(p)) from None


def _messages(value, path, line, field) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise InputError("expected a non-empty list of messages", path, line, field)
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise InputError(f"message {i} must be {{'role': user|assistant|system, 'content': str}}",
                             path, line, field)
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _parse_hh(text: str, path, line, field) -> list[dict]:
    parts = _HH_TURN.split("\n\n" + text.lstrip("\n"))
    # parts: [preamble, role, content, role, content, ...]
    msgs = [{"role": "user" if r == "Human" else "assistant", "content": c.strip()}
            for r, c in zip(parts[1::2], parts[2::2])]
    if not msgs or msgs[-1]["role"] != "assistant":
        raise InputError("HH-RLHF transcript must end with an 'Assistant:' turn", path, line, field)
    return msgs


def _split_conversations(chosen: list[dict], rejected: list[dict], path, line) -> tuple[list[dict], str, str]:
    """Implicit prompt: the shared leading turns; each side's answer is its final assistant turn."""
    for field, conv in (("chosen", chosen), ("rejected", rejected)):
        if conv[-1]["role"] != "assistant":
            raise InputError("conversation must end with an assistant turn", path, line, field)
    prompt_c, prompt_r = chosen[:-1], rejected[:-1]
    if prompt_c != prompt_r:
        raise InputError("chosen and rejected must share every turn but the last", path, line, "rejected")
    return prompt_c, chosen[-1]["content"], rejected[-1]["content"]


def answer_text(value: object, path: str, line: int, field: str) -> str:
    """A response given as a string or as a list of assistant messages."""
    if isinstance(value, list):
        msgs = _messages(value, path, line, field)
        if any(m["role"] != "assistant" for m in msgs):
            raise InputError("response messages must all be assistant turns", path, line, field)
        value = "\n\n".join(m["content"] for m in msgs)
    if not isinstance(value, str) or not value.strip():
        raise InputError("missing or empty (must be a non-empty string)", path, line, field)
    return value


def parse_pair(obj: dict, path: str, line: int) -> PairRow:
    for field in ("chosen", "rejected"):
        if field not in obj:
            raise InputError("missing", path, line, field)
    chosen, rejected = obj["chosen"], obj["rejected"]
    if "prefix" in obj:  # the density fork's pairs_all.jsonl
        prefix = obj["prefix"]
        if not isinstance(prefix, dict):
            raise InputError("expected {'messages': [...]}", path, line, "prefix")
        prompt = _messages(prefix.get("messages"), path, line, "prefix.messages")
        chosen, rejected = answer_text(chosen, path, line, "chosen"), answer_text(rejected, path, line, "rejected")
    elif "prompt" in obj:
        prompt = obj["prompt"]
        if isinstance(prompt, str):
            if not prompt.strip():
                raise InputError("empty prompt", path, line, "prompt")
            prompt = [{"role": "user", "content": prompt}]
        else:
            prompt = _messages(prompt, path, line, "prompt")
        chosen, rejected = answer_text(chosen, path, line, "chosen"), answer_text(rejected, path, line, "rejected")
    elif isinstance(chosen, list) and isinstance(rejected, list):
        prompt, chosen, rejected = _split_conversations(_messages(chosen, path, line, "chosen"),
                                                        _messages(rejected, path, line, "rejected"), path, line)
    elif isinstance(chosen, str) and isinstance(rejected, str) and "Assistant:" in chosen:
        conv_c, conv_r = _parse_hh(chosen, path, line, "chosen"), _parse_hh(rejected, path, line, "rejected")
        prompt, chosen, rejected = _split_conversations(conv_c, conv_r, path, line)
    else:
        raise InputError("no prompt: give 'prompt', 'prefix', full conversations, or HH-RLHF transcripts",
                         path, line, "prompt")
    if not prompt or prompt[-1]["role"] != "user":
        raise InputError("the prompt must end with a user turn", path, line, "prompt")
    chosen, rejected = answer_text(chosen, path, line, "chosen"), answer_text(rejected, path, line, "rejected")
    weight = obj.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        raise InputError(f"must be a positive finite number, got {weight!r}", path, line, "weight")
    pid = obj.get("prefix_id")
    if pid is None:
        pid = prefix_id_of(prompt)
    elif not isinstance(pid, str) or not pid:
        raise InputError("must be a non-empty string", path, line, "prefix_id")
    return PairRow(prompt, chosen, rejected, float(weight), pid, line)


def load_pairs(path: str | os.PathLike, skip_bad: bool = False) -> tuple[list[PairRow], int]:
    """All valid rows and the number skipped (only with skip_bad; otherwise the first bad row raises)."""
    rows, skipped = [], 0
    for number, record in records(path):
        try:
            rows.append(parse_pair(record(), str(path), number))
        except InputError:
            if not skip_bad:
                raise
            skipped += 1
    if not rows:
        raise InputError("no preference pairs in file" + (f" ({skipped} bad rows skipped)" if skipped else ""),
                         path=str(path))
    return rows, skipped


# ---- prompts (GRPO) ------------------------------------------------------------------------------
@dataclass
class PromptRow:
    messages: list[dict]  # ends with a user turn
    prefix_id: str
    row: dict  # the whole JSON object: reward functions read fields such as "answer" from it
    line: int
    weight: float = 1.0
    path: str = ""  # the file (or the rows given in Python) it was read from

    @property
    def where(self) -> str:
        """The row as its user numbers it, for messages: 'prompts.jsonl:15', 'prompts: a list of 64 rows[14]'."""
        return located(self.path, self.line)


def parse_prompt(obj: dict, path: str, line: int) -> PromptRow:
    if is_gsm8k_row(obj):  # {question, answer}: the question is the prompt; the answer stays for the reward
        if not isinstance(obj["question"], str) or not obj["question"].strip():
            raise InputError("must be a non-empty string", path, line, "question")
        obj = {**obj, "prompt": obj["question"]}
    prompt = obj.get("prompt")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise InputError("empty prompt", path, line, "prompt")
        messages = [{"role": "user", "content": prompt}]
    elif prompt is None:
        raise InputError("missing", path, line, "prompt")
    else:
        messages = _messages(prompt, path, line, "prompt")
    if messages[-1]["role"] != "user":
        raise InputError("the prompt must end with a user turn", path, line, "prompt")
    if "answer" in obj and not isinstance(obj["answer"], (str, int, float)):
        raise InputError("must be a string or a number", path, line, "answer")
    pid = obj.get("prefix_id", prefix_id_of(messages))
    if not isinstance(pid, str) or not pid:
        raise InputError("must be a non-empty string", path, line, "prefix_id")
    return PromptRow(messages, pid, obj, line, path=path)


def load_prompts(path: str | os.PathLike) -> list[PromptRow]:
    """GRPO prompts: JSONL {prompt: str | [messages], answer?, prefix_id?}. A preference-pairs file is
    accepted too: its distinct prompts are used."""
    rows: list[PromptRow] = []
    seen: set[str] = set()
    for lineno, obj in read_rows(path):
        if "chosen" in obj and "rejected" in obj:
            pair = parse_pair(obj, str(path), lineno)
            key = json.dumps(pair.prompt)
            if key not in seen:
                seen.add(key)
                rows.append(PromptRow(pair.prompt, pair.prefix_id, obj, lineno, path=str(path)))
            continue
        rows.append(parse_prompt(obj, str(path), lineno))
    if not rows:
        raise InputError("no prompts in file", path=str(path))
    return rows


# ---- weights ------------------------------------------------------------------------------------
def _positive(w, path, line, field="weight") -> float:
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
        raise InputError(f"must be a positive finite number, got {w!r}", path, line, field)
    return float(w)


def load_density(path: str | os.PathLike) -> dict[str, float]:
    """prefix_id -> weight, from a JSONL {prefix_id, weight} file, or the fork's pair
    `prefixes_all.jsonl` + `density_weights.npy` (give either file or their directory)."""
    p = Path(path)
    if p.is_dir() or p.suffix == ".npy" or p.name == "prefixes_all.jsonl":
        d = p if p.is_dir() else p.parent
        return _load_fork_density(d / "prefixes_all.jsonl", d / "density_weights.npy")
    weights: dict[str, float] = {}
    for lineno, obj in read_rows(p):
        pid = obj.get("prefix_id")
        if not isinstance(pid, str) or not pid:
            raise InputError("missing or not a string", str(p), lineno, "prefix_id")
        weights[pid] = _positive(obj.get("weight"), str(p), lineno)
    if not weights:
        raise InputError("no density weights in file", path=str(p))
    return weights


def _load_fork_density(prefixes: Path, npy: Path) -> dict[str, float]:
    import numpy as np

    if not npy.is_file():
        raise InputError("file not found (density_weights.npy goes with prefixes_all.jsonl)", path=str(npy))
    values = np.load(npy)
    rows = list(read_rows(prefixes))
    if values.ndim != 1 or len(values) != len(rows):
        raise InputError(f"{len(values)} weights for {len(rows)} prefixes in {prefixes}: they do not line up",
                         path=str(npy))
    out = {}
    for (lineno, obj), w in zip(rows, values.tolist()):
        pid = obj.get("prefix_id") or obj.get("id")
        if not isinstance(pid, str) or not pid:
            raise InputError("missing or not a string", str(prefixes), lineno, "prefix_id")
        out[pid] = _positive(w, str(npy), None, f"weight[{lineno - 1}]")
    return out


def attach_density(rows: list[PairRow] | list[PromptRow], density: dict[str, float], density_path: str) -> None:
    """Multiply each row's weight by its prompt's density weight; every prompt must have one."""
    for r in rows:
        if r.prefix_id not in density:
            where = f"row {r.line}" if isinstance(r.line, Row) else f"the row on line {r.line}"
            raise InputError(f"{where} has prefix_id {r.prefix_id!r}, which has no density weight",
                             path=density_path)
        r.weight *= density[r.prefix_id]


# ---- split ----------------------------------------------------------------------------------------
def is_val_prefix(prefix_id: str, val_ratio: float) -> bool:
    """Deterministic, world-size-free split keyed by prompt: one prompt never lands on both sides."""
    bucket = int(hashlib.md5(("val:" + prefix_id).encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return bucket < val_ratio


def split_by_prefix(rows: list, val_ratio: float) -> tuple[list, list]:
    train = [r for r in rows if not is_val_prefix(r.prefix_id, val_ratio)]
    val = [r for r in rows if is_val_prefix(r.prefix_id, val_ratio)]
    return train, val


def read_prompts(path: str, density: str | None, val_ratio: float, eval_path: str | None = None,
                 eval_examples: int = 0) -> tuple[list[PromptRow], list[PromptRow]]:
    """--prompts read and checked, --density's weights attached, and split: (train, held out), the held-out rows
    --eval_path's where given, else --val_ratio of the prompts by prefix_id; the first eval_examples of
    them (0: all)."""
    prompts = load_prompts(path)
    if density:
        attach_density(prompts, load_density(density), density)
    if eval_path:
        train_rows, eval_rows = prompts, load_prompts(eval_path)
    else:
        train_rows, eval_rows = split_by_prefix(prompts, val_ratio)
    return train_rows, eval_rows[:eval_examples or None]
