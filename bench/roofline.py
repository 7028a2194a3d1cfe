"""This machine's limits, and the rollout engine's decoding as fractions of them (#90): one JSON line each.

- `memory`: read bandwidth (a sum over a buffer far larger than the caches) and copy bandwidth (bytes read + written),
  the best of a few repeats. A decode step streams every matmul weight once, so the read bandwidth is its roofline.
- `matmul_peak`: square matmuls per dtype (GFLOP/s), what a training step is held against.
- `decode_matmul`: each matmul of the model's decode step at --rows rows, with the weights out of cache (the step's
  other layers' copies read in between, as a step reads them), each way torch can run it on this device: F.linear as
  the model runs it, and weights packed once for the CPU's GEMM (MKL's, oneDNN's), in GB/s of weights streamed.
- `engine`: the engine decoding --rows rows x --new_tokens tokens (eager; --compile 1 also compiled), from plain and
  from packed weights, its tokens/s, the weight bytes it streams per second, and both as fractions of the read
  bandwidth's roofline (every step reads every matmul weight once: roofline tokens/s = rows x read bandwidth /
  weight bytes), and beside it the compute roof (every step multiplies every weight by every row: 2 x rows FLOPs a
  weight, at the fp32 matmul peak) and the two in series (the step's time if reading and multiplying never
  overlapped: a few rows sit where the two roofs meet); call_s, the whole call (the prompt's prefill and any
  repacking too). `profile` (--profile): where an eager call's time goes, by op and shape.

The model: a converted model dir (--model), else SmolLM2-135M-Instruct's shape with random weights (its config's
numbers written here; speed does not depend on the weights' values where every row decodes every token).

    python bench/roofline.py --threads 2 --rows 8 [--model DIR] [--compile 1] [--profile] [--dtypes float32 bfloat16]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# SmolLM2-135M-Instruct's config.json, the numbers that decide a decode step's bytes and shapes
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
               rope_theta=100000.0, tie_word_embeddings=True)


def best_of(fn, repeats: int) -> float:
    """The fastest of `repeats` timed calls, after one untimed."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def memory(mib: int, repeats: int) -> dict:
    import torch

    src = torch.ones(mib * 2 ** 20 // 4)
    dst = torch.empty_like(src)
    n = src.numel() * 4
    return {"bench": "memory", "buffer_mib": mib, "read_gb_s": n / best_of(src.sum, repeats) / 1e9,
            "copy_gb_s": 2 * n / best_of(lambda: dst.copy_(src), repeats) / 1e9}


def matmul_peak(dtype_name: str, n: int, repeats: int) -> dict:
    import torch

    dtype = getattr(torch, dtype_name)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return {"bench": "matmul_peak", "dtype": dtype_name, "n": n,
            "gflops": 2 * n ** 3 / best_of(lambda: a @ b, repeats) / 1e9}


def matmul_ways(rows: int):
    """(name, prepare(weight) -> state, run(x, state)) for each way this torch can run a linear on the CPU."""
    import torch
    import torch.nn.functional as F

    ways = [("linear", lambda w: w, lambda x, w: F.linear(x, w))]
    if torch.backends.mkl.is_available():
        ways.append(("mkl_packed", lambda w: (torch.ops.mkl._mkl_reorder_linear_weight(w, rows), w),
                     lambda x, s: torch.ops.mkl._mkl_linear(x, s[0], s[1], None, rows)))
    if torch.backends.mkldnn.is_available():
        ways.append(("onednn_packed", lambda w: torch.ops.mkldnn._reorder_linear_weight(w, rows),
                     lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")))
    return ways


def decode_matmuls(model, rows: int, dtype_name: str, repeats: int) -> list[dict]:
    """Each distinct matmul shape of the model's decode step, its every layer's weight read in turn (out of cache)."""
    import torch
    import torch.nn as nn

    dtype = getattr(torch, dtype_name)
    matrices = [m.weight for m in model.model.modules() if isinstance(m, nn.Linear)]
    if getattr(model.model, "lm_head", False) is None:  # an LM head tied to the embedding: the logits read it whole
        matrices.append(model.model.embed.weight)
    by_shape: dict[tuple, list] = {}
    for p in matrices:
        by_shape.setdefault(tuple(p.shape), []).append(p.detach().to(dtype).contiguous())
    lines = []
    for shape, weights in by_shape.items():
        x = torch.randn(rows, shape[1], dtype=dtype)
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        line = {"bench": "decode_matmul", "shape": list(shape), "layers": len(weights), "rows": rows,
                "dtype": dtype_name, "mb": nbytes / 1e6}
        for name, prepare, run in matmul_ways(rows):
            try:
                states = [prepare(w) for w in weights]
                seconds = best_of(lambda: [run(x, s) for s in states], repeats)
            except (RuntimeError, NotImplementedError) as e:  # a way this build or dtype lacks
                line[f"{name}_error"] = str(e).splitlines()[0][:100]
                continue
            line[f"{name}_gb_s"] = nbytes / seconds / 1e9
        lines.append(line)
    return lines


def engine_line(model, rows: int, new_tokens: int, prompt_len: int, compile: bool, pack: bool, repeats: int,
                read_gb_s: float, peak_gflops: float) -> dict:
    """The engine decoding rows x new_tokens (one prompt, rows samples, no stop), the fastest of `repeats` calls;
    pack: from weights packed for the CPU's GEMM (engine/packed.py), or plain."""
    import torch

    from nanochat_ext.engine.engine import Engine
    from nanochat_ext.engine.sampling import SamplingConfig

    engine = Engine(model, compile=compile, reserve=prompt_len + new_tokens, drop_finished=False, pack=pack)
    prompt = [[(13 * i) % 1000 + 10 for i in range(prompt_len)]]
    cfg = SamplingConfig(new_tokens, 1.0)
    stats = []
    for k in range(repeats + 1):  # the first call warms (and compiles)
        t = time.perf_counter()
        engine.generate(prompt, rows, cfg, (), 0, [torch.Generator().manual_seed(k)])
        stats.append((engine.last, time.perf_counter() - t))
    s, call_s = min(stats[1:], key=lambda s: s[0].decode_s)
    tok_s = s.row_steps / s.decode_s
    weight_gb_s = s.steps * s.weight_bytes / s.decode_s / 1e9
    roofline_tok_s = rows * read_gb_s * 1e9 / s.weight_bytes
    weights = s.weight_bytes / 4  # fp32: the engine's weights are the model's here
    compute_roof_tok_s = rows * peak_gflops * 1e9 / (2 * rows * weights)
    in_series_tok_s = 1 / (1 / roofline_tok_s + 1 / compute_roof_tok_s)
    return {"bench": "engine", "compiled": compile, "packed": pack, "rows": rows, "new_tokens": new_tokens,
            "prompt": prompt_len, "decode_tok_s": tok_s, "call_s": call_s, "decode_s": s.decode_s,
            "ms_per_step": 1e3 * s.decode_s / s.steps, "weight_mb": s.weight_bytes / 1e6,
            "weight_gb_s": weight_gb_s, "fraction_of_read_bw": weight_gb_s / read_gb_s,
            "roofline_tok_s": roofline_tok_s, "fraction_of_roofline_tok_s": tok_s / roofline_tok_s,
            "compute_roof_tok_s": compute_roof_tok_s, "in_series_tok_s": in_series_tok_s,
            "fraction_of_in_series": tok_s / in_series_tok_s}


def profile_line(model, rows: int, new_tokens: int, prompt_len: int, pack: bool, top: int = 8) -> dict:
    """Where one eager call's time goes (torch.profiler): the top ops by their own CPU time, with their shapes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from nanochat_ext.engine.engine import Engine
    from nanochat_ext.engine.sampling import SamplingConfig

    engine = Engine(model, reserve=prompt_len + new_tokens, drop_finished=False, pack=pack)
    prompt = [[(13 * i) % 1000 + 10 for i in range(prompt_len)]]
    call = lambda: engine.generate(prompt, rows, SamplingConfig(new_tokens, 1.0), (), 0,  # noqa: E731
                                   [torch.Generator().manual_seed(0)])
    call()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        call()
    events = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events)
    return {"bench": "profile", "packed": pack, "rows": rows, "total_ms": total / 1e3,
            "top": [{"op": e.key, "shapes": str(e.input_shapes)[:80], "calls": e.count,
                     "ms": e.self_cpu_time_total / 1e3, "share": e.self_cpu_time_total / total} for e in events[:top]]}


def load_model(path: str | None, workdir: Path):
    """The model to measure (frozen, eval): a converted dir, else SmolLM2's shape with random weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from nanochat_ext.models.loader import load_backbone

    if path is None:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**SMOLLM2)).save_pretrained(workdir / "smollm2_shape")
        path = str(workdir / "smollm2_shape")
    return load_backbone(path, "cpu", frozen=torch.float32).eval()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a converted model dir (default: SmolLM2-135M's shape, random)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--new_tokens", type=int, default=32)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--compile", choices=("0", "1"), default="0", help="1: the compiled engine too")
    p.add_argument("--profile", action="store_true", help="the top ops of an eager call, plain and packed")
    p.add_argument("--buffer_mib", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    b = p.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(b.threads)
    import torch

    torch.set_num_threads(b.threads)
    emit = lambda line: print(json.dumps({**line, "threads": b.threads}), flush=True)  # noqa: E731
    mem = memory(b.buffer_mib, b.repeats)
    emit(mem)
    peaks = {dtype: matmul_peak(dtype, 1024, b.repeats) for dtype in dict.fromkeys(["float32", *b.dtypes])}
    for dtype in b.dtypes:
        emit(peaks[dtype])
    with tempfile.TemporaryDirectory() as d:
        model = load_model(b.model, Path(d))
        for dtype in b.dtypes:
            for line in decode_matmuls(model, b.rows, dtype, b.repeats):
                emit({**line, **{k.replace("_gb_s", "_of_read_bw"): v / mem["read_gb_s"] for k, v in line.items()
                                 if k.endswith("_gb_s")}})
        for compile in ([False, True] if b.compile == "1" else [False]):
            for pack in (False, True):
                emit(engine_line(model, b.rows, b.new_tokens, b.prompt, compile, pack, b.repeats, mem["read_gb_s"],
                                 peaks["float32"]["gflops"]))
        if b.profile:
            for pack in (False, True):
                emit(profile_line(model, b.rows, b.new_tokens, b.prompt, pack))


if __name__ == "__main__":
    main()
