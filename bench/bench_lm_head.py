"""The LM head's log-prob chain (logprobs.token_logprobs_chunked) eager and under --compile (inductor): one chunk of
`rows` completion tokens through a nanochat head (matmul, softcap, fp32 log-softmax at a temperature, gather,
entropy), forward alone (the reference, the old policy) and forward + backward (the policy's update). One JSON line
per mode; the fastest of --repeats. --chunk_tokens below --rows: the rows in chunks, as the trainer runs a
micro-batch of more completion tokens than logprobs.CHUNK_TOKENS (each chunk recomputed in backward).

    python bench/bench_lm_head.py --rows 2048 --vocab 65536 --hidden 768 --threads 2
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=65536)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--chunk_tokens", type=int, default=0, help="rows per chunk (0: all rows in one)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--compiled", default="eager,inductor",
                   help="which chains, comma-separated: eager, inductor (the suite's CPU run: eager; its inductor "
                        "chain is tests/test_grpo.py's test_compiled_lm_head_chain_equals_eager_in_chunks_and_whole)")
    b = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(b.threads)
    import torch

    torch.set_num_threads(b.threads)
    from nanochat_ext.training.logprobs import token_logprobs_chunked

    device = torch.device(b.device)
    g = torch.Generator(device=device).manual_seed(0)
    weight = torch.randn(b.vocab, b.hidden, generator=g, device=device).div_(b.hidden ** 0.5).requires_grad_()
    h = torch.randn(1, b.rows, b.hidden, generator=g, device=device, requires_grad=True)
    target = torch.randint(0, b.vocab, (1, b.rows), generator=g, device=device)

    def head(x):
        return 15 * torch.tanh((x @ weight.t()).float() / 15)

    for compiled in [None if c == "eager" else c for c in b.compiled.split(",")]:
        for mode in ("forward", "forward_backward"):
            def run() -> None:
                with torch.set_grad_enabled(mode == "forward_backward"):
                    logp, _ = token_logprobs_chunked(head, h, target, b.chunk_tokens or b.rows, 0.9,
                                                     compiled=compiled)
                if mode == "forward_backward":
                    logp.sum().backward()

            run()  # warm-up: the compile
            times = []
            for _ in range(b.repeats):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                run()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            print(json.dumps({"bench": "lm_head_chain", "device": device.type, "threads": b.threads,
                              "compiled": compiled or "eager", "mode": mode, "rows": b.rows,
                              "chunk_tokens": b.chunk_tokens or b.rows, "vocab": b.vocab,
                              "hidden": b.hidden, "ms": round(min(times) * 1e3, 2)}), flush=True)


if __name__ == "__main__":
    main()
