"""The compiled decode step's cost against the cache positions in use (#67 item 1): a nanochat GPT (random weights,
a shape whose keys and values outweigh its matrices, as GRPO's long allocations make them) decoding 16 tokens after
a prompt of --short and of --long tokens, in a cache of --slots slots either way (Engine(reserve=...), as GRPO
reserves its longest prompt + completion). Before length buckets a step read every slot whatever its position;
with them it reads its bucket (scheduler.read_length). Both ways (READ_BUCKET as shipped, and one no cache
reaches: the whole cache every step) run inductor's compiled step, each shape warmed first; the line per way and
position reports the fastest decode time per step over --repeats calls.

    python bench/bench_decode_length.py --threads 2
"""
import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slots", type=int, default=2048)
    p.add_argument("--short", type=int, default=64, help="the prompt's length before the first decoded token")
    p.add_argument("--long", type=int, default=1024)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=256)
    p.add_argument("--new_tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    b = p.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(b.threads)
    import torch

    torch.set_num_threads(b.threads)
    from nanochat_ext.engine import scheduler
    from nanochat_ext.engine.engine import Engine
    from nanochat_ext.engine.sampling import SamplingConfig
    from nanochat_ext.models.loader import load_backbone
    from nanochat_ext.tasks.synthetic import make_tiny_gpt

    with tempfile.TemporaryDirectory() as d:
        model = load_backbone(make_tiny_gpt(Path(d) / "gpt", 4096, vintage="current", n_layer=b.n_layer,
                                            n_embd=b.n_embd, n_head=b.n_embd // 64, n_kv_head=b.n_embd // 64,
                                            sequence_len=b.slots)).eval()
    cfg = SamplingConfig(b.new_tokens, 1.0)
    shipped = scheduler.READ_BUCKET
    results = {}
    for way, bucket in (("whole cache", 1 << 30), ("length buckets", shipped)):
        scheduler.READ_BUCKET = bucket
        torch._dynamo.reset()
        engine = Engine(model, compile=True, reserve=b.slots, drop_finished=False)
        for position in (b.short, b.long):
            prompt = [[(7 * i + r) % 4000 + 10 for i in range(position)] for r in range(b.rows)]
            best = None
            for k in range(b.repeats + 1):  # the first call compiles (a graph per bucket it reaches)
                gens = [torch.Generator().manual_seed(r) for r in range(b.rows)]
                engine.generate(prompt, 1, cfg, (), 0, gens)
                if k:
                    per_step = engine.last.decode_s / engine.last.steps
                    best = per_step if best is None else min(best, per_step)
            results[way, position] = best
            print(json.dumps({"bench": "decode_length", "way": way, "slots": engine.states[b.rows].slots,
                              "position": position, "read": scheduler.read_length(position + b.new_tokens,
                                                                                     engine.states[b.rows].slots)
                              or engine.states[b.rows].slots, "rows": b.rows, "n_layer": b.n_layer,
                              "n_embd": b.n_embd, "ms_per_step": round(best * 1e3, 3), "threads": b.threads}),
                  flush=True)
    scheduler.READ_BUCKET = shipped
    print(json.dumps({"bench": "decode_length",
                      "long_over_short_before": round(results["whole cache", b.long]
                                                      / results["whole cache", b.short], 2),
                      "long_over_short_after": round(results["length buckets", b.long]
                                                     / results["length buckets", b.short], 2),
                      "short_speedup": round(results["whole cache", b.short] / results["length buckets", b.short], 2),
                      "long_speedup": round(results["whole cache", b.long] / results["length buckets", b.long], 2)}),
          flush=True)


if __name__ == "__main__":
    main()
