"""One GRPO group through the policy (forward + backward) and the reference (forward), in the layout the
backbone picks for it (`PrefixTree.pays`: one prefix-tree row, or a row per completion), as the GRPO
update and reference pass run it. One JSON line per group shape; the bench's group is short, the others
are what longer completions look like.

    python bench/bench_prefix_tree.py --backbone ASSETS/tiny-llama --threads 2
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"35+8x32": (35, 8, 32), "100+8x128": (100, 8, 128), "200+16x64": (200, 16, 64)}  # prompt, G, new tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backbone", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--repeats", type=int, default=5, help="timed rounds of --steps; the fastest is reported")
    p.add_argument("--steps", type=int, default=5)
    b = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(b.threads)
    import torch

    torch.set_num_threads(b.threads)
    from nanochat_ext.models.loader import load_backbone
    from nanochat_ext.training.logprobs import CompletionLogprobs, make_sequences

    backbone = load_backbone(b.backbone)
    backbone.set_trainable("all")
    model = CompletionLogprobs(backbone)
    for name in b.shapes:
        P, G, L = SHAPES[name]
        g = torch.Generator().manual_seed(0)
        vocab = backbone.vocab_size
        prompt = torch.randint(2, vocab, (P,), generator=g).tolist()
        completions = [torch.randint(2, vocab, (L,), generator=g).tolist() for _ in range(G)]
        batch = make_sequences([prompt], completions, G, 0, share_prompt=True)
        args = (batch.input_ids, batch.gather, batch.target, batch.branches)

        def step() -> None:
            logp, _ = model(*args)
            logp.sum().backward()
            with torch.no_grad():
                model(*args)

        step()
        rounds = []
        for _ in range(b.repeats):
            t0 = time.perf_counter()
            for _ in range(b.steps):
                step()
            rounds.append((time.perf_counter() - t0) / b.steps * 1000)
        print(json.dumps({"bench": "prefix_tree_group", "shape": name,
                          "tree": backbone.shares_prefixes(batch.branches),
                          "threads": b.threads, "ms_per_group": round(min(rounds), 2),
                          "ms_rounds": [round(r, 2) for r in rounds], "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
