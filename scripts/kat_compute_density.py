"""Density stage: inverse-density weights per prompt. Each distinct prompt (prefix_id) is embedded with
the backbone (mean of the final hidden states over its real tokens, L2-normalised); its weight grows
with the mean distance to its k nearest neighbours, so prompts from crowded regions of conversation
space weigh less and rare ones more. Weights are normalised to mean 1, then capped (--cap).

    python -m scripts.kat_compute_density --backbone CKPT --pairs pairs.jsonl
    torchrun --standalone --nproc_per_node=2 -m scripts.kat_compute_density -- --backbone ... --pairs ...

Writes JSONL {prefix_id, weight} (what kat_train_rm, kat_train_grpo and kat_train_dpo --density read); the last line
printed on success names it. Embedding is sharded over ranks; rank 0 writes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from nanochat_ext.cli import MODEL_HELP, add_config, parse, parser, run_script
from nanochat_ext.data.batching import right_pad
from nanochat_ext.data.rows import load_pairs, load_prompts
from nanochat_ext.ddp_common import all_reduce_sum, print0, raise_if_any
from nanochat_ext.errors import InputError
from nanochat_ext.models.compiled import compile_models
from nanochat_ext.models.loader import load_backbone, load_tokenizer_for
from nanochat_ext.runtime.outdir import check_writable
from nanochat_ext.runtime.precision import compute_dtype, precision
from nanochat_ext.runtime.session import Session, SessionConfig
from nanochat_ext.training.setup import ModelConfig
from scripts.flags import add_flag

WEIGHTINGS = ("inverse_density", "fork")


def flags() -> argparse.ArgumentParser:
    p = parser("kat_compute_density", __doc__)
    p.add_argument("--backbone", required=True, help="embedding model: " + MODEL_HELP)
    p.add_argument("--tokenizer", default=None, help="default: found beside the backbone")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--pairs", help="preference pairs (docs/data.md): their distinct prompts are weighted")
    add_flag(src, "kat_compute_density", "prompts")
    p.add_argument("--k", type=int, default=10, help="neighbours per prompt (default: %(default)s)")
    p.add_argument("--weighting", choices=WEIGHTINGS, default="inverse_density",
                   help="inverse_density: weight proportional to the mean kNN distance, so rare prompts count more "
                        "(this project's rule); fork: proportional to 1 / that distance, the rule of the fork this "
                        "project descends from, which favours dense prompts (kept to compare; default: %(default)s)")
    p.add_argument("--cap", type=float, default=None, help="clip weights (after normalising to mean 1) to at most this")
    p.add_argument("--batch", type=int, default=64, help="prompts per forward (default: %(default)s)")
    p.add_argument("--max_len", type=int, default=256, help="prompt tokens kept, from the end (default: %(default)s)")
    add_flag(p, "kat_compute_density", "out")
    add_config(p, ModelConfig, None, "model", only=("nanochat_vintage", "dtype", "compile"))
    add_config(p, SessionConfig, None, "runtime")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parse(flags(), argv)


@torch.no_grad()
def embed(backbone, prompts: list[list[int]], batch: int, pad_id: int, autocast) -> torch.Tensor:
    """Mean-pooled, L2-normalised final hidden states over each prompt's real tokens (right padding)."""
    out = []
    for a in range(0, len(prompts), batch):
        chunk = prompts[a:a + batch]
        lengths = torch.tensor([len(p) for p in chunk])
        ids = right_pad(chunk, pad_id)
        with autocast:
            h = backbone.hidden_states(ids.to(next(backbone.parameters()).device)).float().cpu()
        real = (torch.arange(ids.size(1))[None, :] < lengths[:, None]).float().unsqueeze(-1)
        out.append(F.normalize((h * real).sum(1) / lengths[:, None], dim=-1))
    return torch.cat(out) if out else torch.zeros(0)


def knn_distances(emb: torch.Tensor, rows: list[int], k: int, chunk: int = 2048) -> torch.Tensor:
    """Mean distance from each of `rows` to its k nearest other points, by chunks of rows (never an
    N x N matrix at once)."""
    k = min(k, emb.size(0) - 1)
    out = []
    for a in range(0, len(rows), chunk):
        idx = torch.tensor(rows[a:a + chunk], dtype=torch.long)
        d = torch.cdist(emb[idx], emb)
        d[torch.arange(len(idx)), idx] = float("inf")  # not its own neighbour
        out.append(d.topk(k, dim=1, largest=False).values.mean(1))
    return torch.cat(out) if out else torch.zeros(0)


def compute(args: argparse.Namespace, session: Session) -> Path:
    env = session.env
    base = Path(os.environ.get("NANOCHAT_BASE_DIR", Path.home() / ".cache" / "nanochat"))
    out = Path(args.out) if args.out else base / "density" / "weights.jsonl"
    if out.exists():  # another run's weights (the demo's?): never replaced unasked
        raise InputError(f"{out} exists (an earlier run's weights): give another --out, or delete it to compute it "
                         f"again")
    if args.pairs:
        rows = [(r.prefix_id, r.prompt) for r in load_pairs(args.pairs)[0]]
    else:
        rows = [(r.prefix_id, r.messages) for r in load_prompts(args.prompts)]
    first: dict[str, list[dict]] = {}
    for pid, messages in rows:
        first.setdefault(pid, messages)
    ids = sorted(first)
    if len(ids) < 2:
        raise InputError(f"{len(ids)} distinct prompt(s): density needs at least 2", path=args.pairs or args.prompts)
    if args.k < 1 or (args.cap is not None and args.cap <= 0):
        raise InputError("--k must be at least 1 and --cap positive")
    dtype = compute_dtype(args.dtype, env.device)
    backbone = load_backbone(args.backbone, env.device, vintage=args.nanochat_vintage, frozen=dtype)
    tok = load_tokenizer_for(backbone, args.tokenizer)
    print0(compile_models(args.compile, env.device, backbone))
    raise_if_any(check_writable(out.parent) if env.is_main else None)

    tokens = [tok.render_prompt(first[pid])[-args.max_len:] for pid in ids]
    mine = list(range(env.rank, len(ids), env.world_size))
    emb = torch.zeros(len(ids), backbone.hidden_size, dtype=torch.float32)
    mine_emb = embed(backbone, [tokens[i] for i in mine], args.batch, tok.pad_id, precision(dtype, env.device))
    if mine:
        emb[mine] = mine_emb
    emb = all_reduce_sum(emb)  # every rank filled its own rows
    dist = torch.zeros(len(ids))
    if mine:
        dist[mine] = knn_distances(emb, mine, args.k)  # each rank its own rows again
    dist = all_reduce_sum(dist)
    raw = dist if args.weighting == "inverse_density" else 1.0 / dist.clamp(min=1e-12)
    weights = raw / raw.mean()
    if args.cap is not None:
        weights = weights.clamp(max=args.cap)
    print0(f"density: {len(ids)} prompts, k={min(args.k, len(ids) - 1)}, {args.weighting} weights "
           f"min {weights.min():.3f} mean {weights.mean():.3f} max {weights.max():.3f}")
    if env.is_main:
        tmp = out.with_name(out.name + ".tmp")
        with open(tmp, "w") as f:
            f.writelines(json.dumps({"prefix_id": pid, "weight": round(w, 6)}) + "\n"
                         for pid, w in zip(ids, weights.tolist()))
        os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    return run_script(parse_args(argv), compute, "weights")

if __name__ == "__main__":
    sys.exit(main())
