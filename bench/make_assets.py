"""The CPU benchmark's assets, made from a clone with nothing beside it: a tiny Hugging Face Llama of the anchor
bench's shape (hidden 128, 4 layers, 4 query and 2 key-value heads, SwiGLU MLP 512, a 2048-token byte-level BPE
vocabulary, untied), preference pairs (a sum asked after filler words: the right answer against a near miss) and
GRPO prompts with their answers, the lengths the anchor's settings assume (pairs <= 128 tokens, prompts <= 64).
Deterministic from --seed. bench/run_all.sh uses it where ../shared/anchor-bench is not there (then TRL's rows are
not run); with it there, both sides read the anchor's own assets.

    python bench/make_assets.py --out /tmp/bench-assets
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanochat_ext.tasks.synthetic import make_tiny_hf_llama, write_jsonl  # noqa: E402

N_PAIRS, N_PROMPTS, VOCAB = 2000, 512, 2048


class Questions:
    """Sums asked after a run of made-up words, and answers a near miss away."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        syllables = ["ka", "lo", "mi", "ren", "to", "sa", "vel", "dor", "qui", "an", "es", "ul", "bri", "no", "fa"]
        self.words = sorted({"".join(self.rng.choice(syllables) for _ in range(self.rng.randint(1, 3)))
                             for _ in range(3000)})

    def filler(self, n: int) -> str:
        return " ".join(self.rng.choice(self.words) for _ in range(n)).capitalize() + "."

    def question(self) -> tuple[str, int]:
        a, b = self.rng.randint(0, 99), self.rng.randint(0, 99)
        return f"{self.filler(self.rng.randint(12, 30))} What is {a}+{b}? Answer:", a + b

    def near_miss(self, answer: int) -> int:
        wrong = answer + self.rng.choice([-11, -10, -2, -1, 1, 2, 10, 11])
        return wrong if wrong >= 0 else answer + 3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/bench-assets", help="the dir to write (default: %(default)s)")
    p.add_argument("--seed", type=int, default=1234, help="what is drawn (default: %(default)s)")
    args = p.parse_args(argv)
    out, q = Path(args.out), Questions(args.seed)
    pairs = []
    for _ in range(N_PAIRS):
        prompt, answer = q.question()
        tail = q.filler(q.rng.randint(8, 24))
        pairs.append({"prompt": prompt, "chosen": f" {answer}. {tail}", "rejected": f" {q.near_miss(answer)}. {tail}"})
    prompts = [dict(zip(("prompt", "answer"), (prompt, str(answer)))) for prompt, answer in
               (q.question() for _ in range(N_PROMPTS))]
    texts = [q.filler(q.rng.randint(5, 30)) for _ in range(20000)] + [r["prompt"] + r["chosen"] for r in pairs]
    texts += [f"{a}+{b}={a + b}" for a in range(100) for b in range(0, 100, 7)]
    make_tiny_hf_llama(out / "tiny-llama", args.seed, VOCAB, texts=texts, hidden_size=128, n_layer=4,
                       intermediate_size=512, max_positions=512)
    write_jsonl(out / "pairs.jsonl", pairs)
    write_jsonl(out / "prompts.jsonl", prompts)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
