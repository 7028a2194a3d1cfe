"""GPU throughput and memory of the RM, GRPO and DPO steps on nanochat-shaped models (random init, today's
architecture), run through the library's own step functions. One JSON line per measurement.

    python bench/bench_gpu.py                                   # d12 and d20 on the GPU, bf16 autocast
    python bench/bench_gpu.py --shapes tiny --device cpu --steps 1 --warmup 0   # smoke test (CI runs it)

The trainers' steps are gpu_trainers.py's, the shapes, FLOPs (MFU) and clocks gpu_measure.py's; the rollout engine
alone (eager and CUDA graphs, beside nanochat's Engine) and one optimizer step are here.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_measure import Clock, autocast_for, block_fwd_flops, decode_figures, make_backbone, nanochat_dims, shape_config  # noqa: F401
from gpu_trainers import bench_dpo, bench_grpo, bench_rm

from nanochat_ext.ddp_common import init_dist
from nanochat_ext.engine.engine import Engine
from nanochat_ext.engine.sampling import SamplingConfig
from nanochat_ext.models.backbone import Backbone
from nanochat_ext.runtime.parallel import Parallel
from nanochat_ext.training.optim import make_optimizer


@dataclass(frozen=True)
class BlocksNobodyCloses:
    """What the engine reads of an agent whose python-block ids no row samples: the calculator's state is tracked in
    every decode step, and no block is ever answered."""
    python: tuple[int, int]
    active: bool = True
    turns: bool = False

    def episodes(self, rows: list[dict], group: int) -> None:
        return None


def bench_decode(shape: str, b: argparse.Namespace, device: torch.device) -> Iterator[dict]:
    """The rollout engine alone, as GRPO's generation phase runs it: grpo_prompts prompts of prompt_len tokens x
    group_size samples, every row decoding new_tokens (the stop token held back) at temperature 1, bf16 autocast.
    Eager and compiled (--compile auto: both on CUDA, eager on CPU; 0 or 1: that one), each without and with tools
    (the calculator's state tracked in the step; its tokens are ids no row samples, so no block closes: the cost of
    tools on when nobody calls them), then nanochat's own Engine on the same weights where its source is at hand
    (--nanochat_src: one prompt x the same rows, as its scripts/infer_bench.py runs it)."""
    cfg = shape_config(shape, b.vintage)
    n, G, P, L = b.grpo_prompts, b.group_size, b.prompt_len, b.new_tokens
    policy = make_backbone(cfg, device, 0)
    stop = cfg.vocab_size - 1
    sampling = SamplingConfig(max_new_tokens=L, temperature=1.0, min_new_tokens=L)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, stop, (P,), generator=g).tolist() for _ in range(n)]
    modes = {"0": [False], "1": [True]}.get(b.compile, [False, True] if device.type == "cuda" else [False])
    never = cfg.vocab_size + 1  # a token id past the vocabulary: sampled by no row
    tools = BlocksNobodyCloses((never, never + 1))
    # Each row as it is measured, the ones a short GPU lease needs most first: ours eager, nanochat's Engine (the
    # peer), ours compiled, then the tools rows.
    for compiled, with_tools in [(c, False) for c in modes] + [(c, True) for c in modes]:
        yield decode_row(shape, policy, prompts, G, sampling, stop, compiled, tools if with_tools else None, b, device)
        if b.nanochat_src and (compiled, with_tools) == (modes[0], False):
            try:  # a peer's source at another commit: its failure is a row, not the end of the rows after it
                yield bench_nanochat_engine(shape, policy, b, device)
            except Exception as e:
                yield {"bench": "gpu_decode", "shape": shape, "engine": "nanochat",
                       "error": f"{type(e).__name__}: {e}".splitlines()[0]}


def decode_row(shape: str, policy: Backbone, prompts: list, G: int, sampling: SamplingConfig, stop: int,
               compiled: bool, tools, b: argparse.Namespace, device: torch.device) -> dict:
    """One engine (eager or compiled, with or without tools) generating warmup + steps times: its decode figures."""
    engine = Engine(policy, compile=compiled, agent=tools, end_check_every=b.end_check_every)
    runs = []
    with Clock(device) as clock:
        for rep in range(b.warmup + b.steps):
            with autocast_for(device):
                engine.generate(prompts, G, sampling, stop, 0,
                                [torch.Generator().manual_seed(i) for i in range(len(prompts))])
            if rep >= b.warmup:
                runs.append(engine.last)
    return {"bench": "gpu_decode", "shape": shape,
            "engine": f"ours {'compiled' if compiled else 'eager'}{' +tools' if tools else ''}",
            "rows": len(prompts) * G, "prompt_len": len(prompts[0]), "new_tokens": sampling.max_new_tokens,
            "end_check_every": engine.end_check_every, **decode_figures(runs, device),
            "weight_gb": round(runs[-1].weight_bytes / 2**30, 3),
            "kept_gb": round(engine.kept_bytes() / 2**30, 3), "peak_mem_gb": clock.peak_gb}


def bench_nanochat_engine(shape: str, policy: Backbone, b: argparse.Namespace, device: torch.device) -> dict:
    """nanochat's own Engine (its source at --nanochat_src, a checkout's root) decoding our model's weights (the
    parameter names are nanochat's): one prompt of prompt_len tokens x grpo_prompts * group_size samples."""
    sys.path.insert(0, str(Path(b.nanochat_src).resolve()))
    from nanochat.engine import Engine as NanochatEngine
    from nanochat.gpt import GPT as NanochatGPT
    from nanochat.gpt import GPTConfig as NanochatConfig

    c = policy.model.config
    with torch.device("meta"):
        model = NanochatGPT(NanochatConfig(**c.nanochat_dict()))
    model.to_empty(device=device)
    model.init_weights()  # its buffers (rotary tables); the weights come next
    model.load_state_dict(policy.model.state_dict())
    model.eval()
    rows, P, L = b.grpo_prompts * b.group_size, b.prompt_len, b.new_tokens
    prompt = torch.randint(0, c.vocab_size - 1, (P,), generator=torch.Generator().manual_seed(0)).tolist()
    times, steps = [], 0
    for rep in range(b.warmup + b.steps):
        with Clock(device) as clock:
            steps = sum(1 for _ in NanochatEngine(model, _NanochatTokens(c.vocab_size)).generate(
                prompt, num_samples=rows, max_tokens=L, temperature=1.0))
        if rep >= b.warmup:
            times.append(clock.s)
    s = sum(times) / len(times)
    return {"bench": "gpu_decode", "shape": shape, "engine": "nanochat", "rows": rows, "prompt_len": P,
            "new_tokens": L, "decode_tok_per_s": round(rows * steps / s, 1), "decode_mbu": None,
            "prefill_s": None, "note": "tokens/s over the whole call, prefill included"}


class _NanochatTokens:
    """What nanochat's Engine asks of a tokenizer when it samples without tools: special token ids (the top of
    the vocabulary, which a random prompt does not use) and a BOS."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode_special(self, name: str) -> int:
        return self.vocab_size - 2

    def get_bos_token_id(self) -> int:
        return self.vocab_size - 1


def bench_optimizer(shape: str, b: argparse.Namespace, device: torch.device) -> list[dict]:
    """One optimizer step over the whole policy, --optimizer adamw against muon (nanochat's MuonAdamW, chat_rl's
    rates), the gradients random and fixed: milliseconds per step and the state's memory."""
    policy = make_backbone(shape_config(shape, b.vintage), device, 0)
    params = list(policy.parameters())
    g = torch.Generator(device=device).manual_seed(0)
    grads = [torch.randn(p.shape, generator=g, device=device) * 1e-3 for p in params]
    rows = []
    for kind, lr in (("adamw", 1e-6), ("muon", 0.05)):
        optimizer = make_optimizer(kind, policy.model, params, lr, 0.0, device)
        times = []
        for step in range(b.warmup + b.steps):
            for p, grad in zip(params, grads):
                p.grad = grad.clone()
            with Clock(device) as clock:
                optimizer.step()
            if step >= b.warmup:
                times.append(clock.s)
            optimizer.zero_grad(set_to_none=True)
        state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor))
        rows.append({"bench": "gpu_optimizer", "shape": shape, "optimizer": kind,
                     "params": sum(p.numel() for p in params),
                     "ms_per_step": round(1e3 * sum(times) / len(times), 2), "state_gb": round(state / 2**30, 3)})
        del optimizer
    return rows


def options(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench's flags (argv: as on the command line; None: sys.argv), every one at its default unless given; the
    tests build their runs from it too."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--shapes", nargs="+", default=["d12", "d20"])
    p.add_argument("--vintage", default="current", help="nanochat architecture (vintages.VINTAGES; default: today's)")
    p.add_argument("--only", choices=("rm", "grpo", "dpo", "decode", "optim", "both", "all"), default="all",
                   help="which benches (both: rm and grpo, as before the decode bench; optim: one step of "
                        "--optimizer adamw and muon)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per measurement")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--run_steps", type=int, default=500,
                   help="the GRPO run --compile auto decides the engine for "
                        "(its --max_steps; the README's stages: 500)")
    p.add_argument("--rm_pairs", type=int, default=32, help="pairs per RM step")
    p.add_argument("--rm_len", type=int, default=512, help="tokens per RM sequence")
    p.add_argument("--grpo_prompts", type=int, default=16, help="prompts per GRPO step (x group_size completions)")
    p.add_argument("--group_size", type=int, default=16)
    p.add_argument("--prompt_len", type=int, default=128)
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--micro", type=int, default=64, help="sequences per forward in scoring / reference / training")
    p.add_argument("--dpo_pairs", type=int, default=32, help="pairs per DPO step")
    p.add_argument("--dpo_len", type=int, default=256, help="tokens of each DPO response (after --prompt_len)")
    p.add_argument("--dpo_micro", type=int, default=8, help="pairs per DPO forward")
    p.add_argument("--peak_tflops", type=float, default=None, help="the device's dense bf16 peak, if not known here")
    p.add_argument("--compile", choices=("auto", "0", "1"), default="auto",
                   help="the trainers' --compile (blocks, and GRPO's decode step as its engine decides)")
    p.add_argument("--parallel", choices=("none", "fsdp"), default="none",
                   help="fsdp: the RM (full fine-tune only) and GRPO benches under FSDP2 on a one-rank group, as "
                        "`torchrun --nproc_per_node 1 ... --parallel fsdp` trains (none: the plain module)")
    p.add_argument("--activation_checkpointing", action="store_true")
    p.add_argument("--lora_r", type=int, default=0,
                   help="GRPO with LoRA adapters of this rank on every linear layer of the blocks (peft), as "
                        "kat_train_grpo --lora_r trains (0: the full fine-tune)")
    p.add_argument("--end_check_every", type=int, default=None,
                   help="the engine's decode steps between reads of whether every row stopped (default: its own)")
    p.add_argument("--nanochat_src", default=None,
                   help="a nanochat checkout's root: its Engine decodes beside ours in the decode bench")
    b = p.parse_args(argv)
    b.par = None  # main makes the one-rank group under --parallel fsdp
    if b.lora_r and b.parallel == "fsdp":
        p.error("--lora_r trains under ddp (kat_train_grpo refuses it with --parallel fsdp)")
    return b


def main() -> None:
    b = options()
    device = torch.device(b.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    if b.parallel == "fsdp":
        b.par = Parallel("fsdp", init_dist(device.type, group=True), torch.bfloat16)
    for shape in b.shapes:
        if b.only in ("rm", "both", "all"):
            for unfreeze in ("0", "2", "all") if b.par is None else ("all",):
                print(json.dumps({**bench_rm(shape, unfreeze, b, device), "device": device_name(device),
                                  "torch": torch.__version__}), flush=True)
        if b.only in ("grpo", "both", "all"):
            print(json.dumps({**bench_grpo(shape, b, device), "device": device_name(device),
                              "torch": torch.__version__}), flush=True)
        if b.only in ("dpo", "all"):
            print(json.dumps({**bench_dpo(shape, b, device), "device": device_name(device),
                              "torch": torch.__version__}), flush=True)
        if b.only in ("decode", "all"):
            for row in bench_decode(shape, b, device):
                print(json.dumps({**row, "device": device_name(device), "torch": torch.__version__}), flush=True)
        if b.only in ("optim", "all") and b.par is None:
            for row in bench_optimizer(shape, b, device):
                print(json.dumps({**row, "device": device_name(device), "torch": torch.__version__}), flush=True)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


if __name__ == "__main__":
    main()
