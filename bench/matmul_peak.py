"""This CPU's fp32 matmul throughput with plain torch (the peak the RM's FLOP/s is compared with), one
JSON line per thread count. Square matmuls of a few sizes, the best of several repeats.

    python bench/matmul_peak.py --threads 1 2
"""
import argparse
import json
import time

import torch


def gflops(n: int, threads: int, repeats: int = 5) -> float:
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(4):
            a @ b
        best = min(best, (time.perf_counter() - t) / 4)
    return 2 * n ** 3 / best / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024, 2048])
    args = p.parse_args()
    for threads in args.threads:
        per_size = {n: round(gflops(n, threads), 1) for n in args.sizes}
        print(json.dumps({"bench": "matmul_peak_fp32", "threads": threads, "gflops_by_size": per_size,
                          "peak_gflops": max(per_size.values()), "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
