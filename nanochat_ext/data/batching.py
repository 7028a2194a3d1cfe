"""From records to batches: prompt and response token ids cut to fit (prompt from the left, response from the right),
pairs tokenized, global batches planned over ranks and micro-batches and drawn the same way on every rank, rows padded
and packed (a pair's prompt once, as a prefix tree, with its two responses as branches).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.data import DistributedSampler

from nanochat_ext.config import micro_batch, option
from nanochat_ext.data.rows import PairRow, PromptRow, attach_density, load_density, load_pairs, split_by_prefix
from nanochat_ext.ddp_common import print0
from nanochat_ext.errors import InputError
from nanochat_ext.tokenizer import TokenizerWrapper

LONG_PAIRS = ("truncate", "drop")
WEIGHT_MODES = ("mean", "sum", "none")


@dataclass(frozen=True)
class BatchConfig:
    """How many examples a step learns from, how many go through the model at once, and their order."""
    batch_size: int = option(32, "GLOBAL {unit} per optimizer step", type=int)
    device_batch_size: int | str | None = option(
        None, "{micro_unit} per forward on each rank; gradient accumulation makes up the rest. 'auto' (the default on "
              "CUDA): the largest that divides the rank's share and fits the free memory by the memory model, the "
              "same on every rank (logged with its figures). Default on CPU: the rank's whole share", type=micro_batch)
    seed: int = option(0, "data order{seeds}", type=int)

    def plan(self, world: int, micro: int | None = None) -> BatchPlan:
        """The global batch over `world` ranks in micro-batches of `micro` (None: --device_batch_size as given, else the
        rank's whole share); one line where it does not split."""
        given = None if self.device_batch_size in (None, "auto") else self.device_batch_size
        return BatchPlan.make(self.batch_size, world, micro or given)

    def loader(self, n: int, world: int, rank: int, micro: int | None = None) -> GlobalBatchLoader:
        """Rank `rank`'s batches of n examples (`plan`'s); one line where the examples make no batch."""
        return GlobalBatchLoader(n, self.plan(world, micro), rank, self.seed)


@dataclass(frozen=True)
class PairsConfig:
    """The preference pairs, how a pair's weight counts, and what becomes of a pair too long."""
    pairs: str = option(None, "preference pairs: JSONL, parquet, Arrow or a datasets save_to_disk dir (formats: "
                              "docs/data.md)", required=True)
    skip_bad_rows: bool = option(False, "skip malformed pair rows (and report how many) instead of stopping at the "
                                        "first", action="store_true")
    weight_mode: str = option("mean", "mean: sum(w*loss)/sum(w) over the global batch; sum: sum(w*loss)/n_pairs "
                                      "(weights keep their scale); none: ignore weights", choices=WEIGHT_MODES)
    weight_cap: float | None = option(None, "clip each pair's weight to at most this", type=float,
                                      check=(lambda v: v > 0, "> 0 (a pair's weight is clipped to it)"))
    long_pairs: str = option("truncate", "a pair longer than --max_len: truncate (both sides keep the same prompt "
                                         "window, the responses are cut from the right) or drop it, as TRL does",
                             choices=LONG_PAIRS)


def cut_to_fit(prompt: list[int], response: list[int], max_len: int,
               bos_id: int | None) -> tuple[list[int], list[int]]:
    """(prompt, response) cut to max_len tokens together: the prompt from the left, the response from the
    right. The prompt keeps at least half the budget (when it is that long) so the response is never
    judged without its question; a cut prompt keeps BOS."""
    if len(prompt) + len(response) <= max_len:
        return prompt, response
    keep_prompt = min(len(prompt), max_len // 2)
    response = response[:max_len - keep_prompt]
    n = max_len - len(response)
    if n < len(prompt):
        head = [bos_id] if bos_id is not None and prompt[:1] == [bos_id] else []
        prompt = head + prompt[len(prompt) - (n - len(head)):]
    return prompt, response


def truncate(prompt: list[int], response: list[int], max_len: int, bos_id: int | None) -> list[int]:
    """prompt + response in at most max_len tokens (see cut_to_fit)."""
    p, r = cut_to_fit(prompt, response, max_len, bos_id)
    return p + r


def encode_prompts(rows: list[PromptRow], render: Callable[[list[dict]], list[int]], context: int, max_new_tokens: int,
                   path: str | None, flag: str = "--max_new_tokens") -> list[list[int]]:
    """Each prompt's token ids, rendered for generation (render: the tokenizer's render_prompt, or an agent's, which
    adds its tools); a prompt that leaves no room in the model's context for max_new_tokens (given by `flag`) is one
    line naming the file, the row and the field, before anything is decoded."""
    out = []
    for r in rows:
        ids = render(r.messages)
        if len(ids) + max_new_tokens > context:
            raise InputError(f"prompt of {len(ids)} tokens + {flag} {max_new_tokens} exceeds the policy's context of "
                             f"{context}", path=path, line=r.line, field="prompt")
        out.append(ids)
    return out



@dataclass
class TokenizedPair:
    chosen: list[int]
    rejected: list[int]
    weight: float
    prompt_len: int = 0  # tokens of the prompt both sequences start with
    ref: tuple[float, float] | None = None  # the reference's log-probs of the two responses, once computed (DPO)

    @property
    def row_length(self) -> int:
        """Tokens in the pair's row (collate_pairs): what both share once, then the rest of each."""
        return len(self.chosen) + len(self.rejected) - shared_prefix([self.chosen, self.rejected])


def tokenize_pairs(rows: list[PairRow], tok: TokenizerWrapper, max_len: int,
                   long_pairs: str = "truncate") -> tuple[list[TokenizedPair], int]:
    """Token ids of each pair and how many pairs did not fit max_len. A pair that does not fit is
    dropped ('drop', as TRL does) or cut ('truncate'): both sides get the same prompt window (the one
    the longer response leaves), so chosen and rejected are always judged on the same context."""
    out, n_long = [], 0
    for r in rows:
        p = tok.render_prompt(r.prompt)
        chosen, rejected = tok.render_response(r.chosen), tok.render_response(r.rejected)
        longer = max(chosen, rejected, key=len)
        if len(p) + len(longer) > max_len:
            n_long += 1
            if long_pairs == "drop":
                continue
            p, _ = cut_to_fit(p, longer, max_len, tok.bos_id)
            chosen, rejected = chosen[:max_len - len(p)], rejected[:max_len - len(p)]
        out.append(TokenizedPair(p + chosen, p + rejected, r.weight, len(p)))
    return out, n_long


def read_pairs(path: str, density: str | None, val_ratio: float,
               skip_bad: bool = False) -> tuple[list[PairRow], list[PairRow], list[PairRow]]:
    """--pairs read and checked (the rows --skip_bad_rows skipped are counted in the log), --density's weights
    attached, split by prompt: (all rows, train, held out)."""
    rows, skipped = load_pairs(path, skip_bad=skip_bad)
    if skipped:
        print0(f"data: skipped {skipped} bad rows of {path}")
    if density:
        attach_density(rows, load_density(density), density)
    return rows, *split_by_prefix(rows, val_ratio)


def fit_max_len(max_len: int | None, context: int, model: str) -> int:
    """--max_len, by default the model's context up to 1024; one line where it exceeds the context."""
    if max_len is None:
        return min(1024, context)
    if max_len > context:
        raise InputError(f"--max_len {max_len} exceeds the {model}'s context of {context}")
    return max_len


def tokenize_splits(train_rows: list[PairRow], val_rows: list[PairRow], tok: TokenizerWrapper, max_len: int,
                    long_pairs: str, path: str) -> tuple[list[TokenizedPair], list[TokenizedPair]]:
    """Both splits tokenized (tokenize_pairs), the pairs that did not fit counted in the log; one line when no
    training pair is left."""
    train, long_train = tokenize_pairs(train_rows, tok, max_len, long_pairs)
    val, long_val = tokenize_pairs(val_rows, tok, max_len, long_pairs)
    if long_train or long_val:
        print0(f"data: {long_train} of {len(train_rows)} train and {long_val} of {len(val_rows)} val pairs are longer "
               f"than --max_len {max_len}: {'dropped' if long_pairs == 'drop' else 'truncated'}")
    if not train:
        raise InputError(f"no training pairs left: every pair is longer than --max_len {max_len} (--long_pairs drop)",
                         path=path)
    return train, val


@dataclass
class BatchPlan:
    """How a global batch of `batch_size` examples splits over `world_size` ranks and micro-batches."""
    batch_size: int
    world_size: int
    device_batch_size: int

    @classmethod
    def make(cls, batch_size: int, world_size: int, device_batch_size: int | None) -> BatchPlan:
        if batch_size <= 0:
            raise InputError(f"--batch_size must be positive, got {batch_size}")
        if batch_size % world_size:
            raise InputError(f"--batch_size {batch_size} does not split over {world_size} ranks "
                             f"(make it a multiple of {world_size})")
        per_rank = batch_size // world_size
        dbs = device_batch_size or per_rank
        if dbs <= 0 or per_rank % dbs:
            raise InputError(f"--batch_size {batch_size} over {world_size} ranks is {per_rank} per rank, "
                             f"which --device_batch_size {dbs} does not divide")
        return cls(batch_size, world_size, dbs)

    @property
    def per_rank(self) -> int:
        return self.batch_size // self.world_size

    @property
    def accum_steps(self) -> int:
        return self.per_rank // self.device_batch_size


class GlobalBatchLoader:
    """Yields, for each optimizer step, this rank's micro-batches of dataset indices.

    The global batch at step s is the same set of examples whatever the world size: the epoch's
    permutation comes from DistributedSampler(seed, set_epoch), whose rank r takes positions
    r, r+W, ...; rank r's slice k of length B/W therefore covers global positions [kB, (k+1)B).
    The position is a function of the step alone, so a resumed run picks up exactly where it was.
    """

    def __init__(self, n: int, plan: BatchPlan, rank: int, seed: int):
        if n < plan.batch_size:
            raise InputError(f"{n} training examples are fewer than one global batch of {plan.batch_size}")
        self.plan, self.n = plan, n
        self.sampler = DistributedSampler(range(n), num_replicas=plan.world_size, rank=rank,
                                          shuffle=True, seed=seed, drop_last=True)
        self.steps_per_epoch = (n // plan.world_size) // plan.per_rank

    def micro_batches(self, step: int) -> list[list[int]]:
        epoch, k = divmod(step, self.steps_per_epoch)
        self.sampler.set_epoch(epoch)
        mine = list(self.sampler)[k * self.plan.per_rank:(k + 1) * self.plan.per_rank]
        d = self.plan.device_batch_size
        return [mine[i:i + d] for i in range(0, len(mine), d)]


def rank_chunks(n: int, world: int, rank: int, size: int) -> list[list[int]]:
    """This rank's share of n items (rank, rank + world, ...) in chunks of `size`, as many chunks on every rank (an
    empty one where a rank has fewer): a forward of a DDP or FSDP model is collective, so each rank runs as many."""
    mine = list(range(rank, n, world))
    return [mine[i:i + size] for i in range(0, -(-n // world), size)]


def shared_prefix(seqs: list[list[int]]) -> int:
    """Length of the longest common prefix of seqs, leaving each at least one token of its own."""
    n = 0
    for column in zip(*seqs):
        if any(t != column[0] for t in column):
            break
        n += 1
    return min(n, *(len(s) - 1 for s in seqs))


def prefix_tree_rows(groups: list[list[list[int]]]) -> tuple[list[list[int]], list[list[int]]]:
    """Each group of sequences as one PrefixTree row: their common prefix once, then the rest of each;
    and each row's lengths [prefix, rest 1, ..., rest K]."""
    rows, lengths = [], []
    for seqs in groups:
        n = shared_prefix(seqs)
        rows.append(seqs[0][:n] + [t for s in seqs for t in s[n:]])
        lengths.append([n] + [len(s) - n for s in seqs])
    return rows, lengths


def right_pad(rows: list[list[int]], pad_id: int) -> torch.Tensor:
    """(len(rows), longest) token ids, each row padded on the right."""
    ids = torch.full((len(rows), max(map(len, rows))), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
    return ids


def by_length(micro_batches: list[list[int]], length: Callable[[int], int]) -> list[list[int]]:
    """The same examples in micro-batches of the same sizes, regrouped from shortest to longest, so a
    rank that accumulates several micro-batches pads each to a length near its own examples'. The loss
    is normalised over the whole global batch, so the grouping does not change it."""
    ordered = sorted((i for mb in micro_batches for i in mb), key=length)
    out, start = [], 0
    for mb in micro_batches:
        out.append(ordered[start:start + len(mb)])
        start += len(mb)
    return out


def collate_pairs(pairs: list[TokenizedPair], pad_id: int) -> dict[str, torch.Tensor]:
    """Each pair as one right-padded PrefixTree row (B, T): the tokens chosen and rejected share (the
    prompt, at least) once, then the rest of chosen, then the rest of rejected; lengths (B, 3).
    tokens: the pairs' tokens counted as separate sequences (the work TRL-style batching does);
    computed: the tokens in the rows, each computed once (where the model shares them, see
    Backbone.shares_prefixes)."""
    rows, lengths = prefix_tree_rows([[p.chosen, p.rejected] for p in pairs])
    weights = torch.tensor([p.weight for p in pairs], dtype=torch.float32)
    return {"input_ids": right_pad(rows, pad_id), "lengths": torch.tensor(lengths, dtype=torch.long),
            "weights": weights, "tokens": sum(len(p.chosen) + len(p.rejected) for p in pairs),
            "computed": sum(map(len, rows))}
