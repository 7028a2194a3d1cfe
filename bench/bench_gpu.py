"""GPU throughput and memory of the RM and GRPO steps on nanochat-shaped models (random init, today's
architecture), run through the library's own step functions. One JSON line per measurement.

    python bench/bench_gpu.py                                   # d12 and d20 on the GPU, bf16 autocast
    python bench/bench_gpu.py --shapes tiny --device cpu --steps 1 --warmup 0   # smoke test (CI runs it)

Shapes: dN = nanochat's depth-N model: N layers, width 64*N rounded up to a multiple of 128, heads of
128, vocab 65536 (dN:V for another: d24:32768 is nanochat's speedrun model), context 2048. Peak memory without a GPU: bench/memory_estimate.py.

FLOPs, in nanochat's convention (a (m x k)(k x n) matmul is 2mkn; attention counts its full key
range, no causal halving, a windowed layer its window). Per token of a T-token sequence, one forward
pass through blocks B costs
    fwd(B) = 2 * matmul_params(B) + 4 * sum over layers l in B of d_model * min(window_l, T)
and a backward pass twice that. So
    RM step   = tokens * (fwd(all blocks) + 2 * fwd(trainable blocks))   (no LM head; frozen blocks
                below the first trainable one need no backward at all)
    GRPO step = tokens * 3 * fwd(all blocks) + completion tokens * 6 * d_model * vocab   (LM head only
                at completion positions)
MFU = FLOPs / seconds / peak, the peak being the device's dense bf16 tensor-core rate (H100/H200 SXM:
989 TFLOP/s; --peak_tflops for another). Generation is memory-bound and is given in tokens/s only.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanochat_ext.algorithms.advantages import group_advantages
from nanochat_ext.algorithms.grpo import LOSS_STATS, LossConfig, per_token, policy_backward
from nanochat_ext.algorithms.rm import rm_backward
from nanochat_ext.ddp_common import init_dist
from nanochat_ext.generation.decode_cost import decode_compiled, peak_bandwidth
from nanochat_ext.generation.engine import Engine
from nanochat_ext.generation.sampling import SamplingConfig
from nanochat_ext.models.backbone import Backbone, hold_frozen_in
from nanochat_ext.models.compiled import compile_models, compile_stats
from nanochat_ext.models.gpt import GPT, GPTConfig, padded
from nanochat_ext.models.lora import LoraSpec, WithoutAdapters, apply_lora
from nanochat_ext.models.reward_model import RewardModel, RewardScorer
from nanochat_ext.runtime.parallel import Parallel, checkpoint_activations
from nanochat_ext.training.logprobs import CompletionLogprobs, make_sequences, reference_model, token_logprobs
from nanochat_ext.training.optim import make_adamw, make_optimizer

PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0, "L40S": 362.1, "A10G": 70.0}


def nanochat_dims(name: str) -> tuple[int, int, int, int]:
    """(depth, model_dim, heads, vocab) of shape `name`: 'dN' or 'dN:VOCAB' (default vocab 65536, what the
    GPU baseline measured; nanochat's speedrun tokenizer has 32768: 'd24:32768'), by nanochat's own rule
    (scripts/base_train.py): model_dim = depth * 64 rounded up to a multiple of head_dim 128, heads of 128.
    'tiny': the CPU smoke test's."""
    if name == "tiny":
        return 2, 64, 4, 512
    depth, _, vocab = name.removeprefix("d").partition(":")
    depth = int(depth)
    model_dim = -(-depth * 64 // 128) * 128
    return depth, model_dim, model_dim // 128, int(vocab or 65536)


def shape_config(name: str, vintage: str = "current") -> GPTConfig:
    """nanochat's model of shape `name` (nanochat_dims) of that vintage. d20 is 561M parameters up to
    dec2025; today's value embeddings bring it to 1.40B."""
    depth, width, heads, vocab = nanochat_dims(name)
    if name == "tiny":
        return GPTConfig(sequence_len=256, vocab_size=vocab, n_layer=depth, n_head=heads, n_kv_head=heads,
                         n_embd=width, window_pattern="SL", vintage=vintage, padded_vocab_size=vocab)
    return GPTConfig(sequence_len=2048, vocab_size=vocab, n_layer=depth, n_head=heads, n_kv_head=heads,
                     n_embd=width, window_pattern="SSSL", vintage=vintage, padded_vocab_size=padded(vocab))


_INITIAL: dict[tuple[str, int], dict[str, torch.Tensor]] = {}  # (config, seed) -> weights drawn on CPU


def make_backbone(cfg: GPTConfig, device: torch.device, seed: int) -> Backbone:
    """A random model of that shape, its weights drawn once per (shape, seed) on CPU (init_weights' generator
    is a CPU one; drawing 1.4B of them takes long enough to matter in a 10-minute GPU call) and copied after."""
    key = (repr(cfg), seed)
    if key not in _INITIAL:
        model = GPT(cfg)
        model.init_weights(seed)
        _INITIAL[key] = model.state_dict()
    with torch.device(device):
        model = GPT(cfg)
    model.load_state_dict(_INITIAL[key])
    return Backbone("nanochat", model, f"random {cfg.n_layer}x{cfg.n_embd}").eval()


def block_fwd_flops(cfg: GPTConfig, blocks: list, T: int) -> float:
    """Forward FLOPs per token through `blocks` (see the module docstring)."""
    matmul = sum(p.numel() for b in blocks for p in b.parameters() if p.dim() == 2)
    windows = GPT._window_sizes(cfg)
    first = cfg.n_layer - len(blocks)
    return 2 * matmul + 4 * sum(cfg.n_embd * min(windows[first + i], T) for i in range(len(blocks)))


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


class Clock:
    """Wall time of a phase (synchronised on CUDA) and its peak allocated memory."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_gb = torch.cuda.max_memory_allocated(self.device) / 2**30
        else:
            self.peak_gb = None
        self.s = time.perf_counter() - self.t0


def autocast_for(device: torch.device) -> torch.autocast:
    return torch.autocast(device.type, dtype=torch.bfloat16)


def bench_rm(shape: str, unfreeze: str, b: argparse.Namespace, device: torch.device) -> dict:
    cfg = shape_config(shape, b.vintage)
    T = min(b.rm_len, cfg.sequence_len)
    backbone = make_backbone(cfg, device, 0)
    backbone.set_trainable(unfreeze)
    backbone.model.lm_head.weight.requires_grad_(False)
    hold_frozen_in(backbone, torch.bfloat16)
    model = RewardModel(backbone).to(device)
    model.init_head(0)
    compiled = compile_models(b.compile, device, backbone)
    shard(model, backbone, b)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_adamw(trainable, 1e-5, 0.0, device)
    g = torch.Generator().manual_seed(0)
    n = b.rm_pairs
    # Separate full-length rows (no shared prompt): the FLOPs are those of 2n rows of T tokens.
    batch = {"input_ids": torch.randint(0, cfg.vocab_size, (2 * n, T), generator=g),
             "lengths": torch.full((2 * n,), T), "weights": torch.ones(n), "tokens": 2 * n * T, "computed": 2 * n * T}
    times, peaks = [], []
    # The first warm-up step is 64 tokens shorter: compiled, a new length makes torch recompile with symbolic
    # sizes, so the timed steps run the graph that ragged training runs, not one specialised to T.
    cut = T - min(64, T // 2)
    short = {**batch, "input_ids": batch["input_ids"][:, :cut], "lengths": torch.full((2 * n,), cut)}
    for step in range(b.warmup + b.steps):
        with Clock(device) as c:
            rm_backward(model, [short if step == 0 and b.warmup else batch], "mean", None, device, autocast_for(device))
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if step >= b.warmup:
            times.append(c.s)
            peaks.append(c.peak_gb)
    s = sum(times) / len(times)
    trainable_blocks = [blk for blk in backbone.blocks if any(p.requires_grad for p in blk.parameters())]
    flops = 2 * n * T * (block_fwd_flops(cfg, list(backbone.blocks), T) + 2 * block_fwd_flops(cfg, trainable_blocks, T))
    peak = peak_tflops(device, b.peak_tflops)
    return {"bench": "gpu_rm", "shape": shape, "vintage": b.vintage, "unfreeze_last": unfreeze, "pairs_per_step": n, "seq_len": T,
            "params": sum(p.numel() for p in model.parameters()), "trainable": sum(p.numel() for p in trainable),
            "ms_per_step": round(1000 * s, 2), "pairs_per_s": round(n / s, 2), "tokens_per_s": round(2 * n * T / s, 1),
            "tflops": round(flops / s / 1e12, 3), "mfu": round(flops / s / 1e12 / peak, 4) if peak else None,
            "peak_mem_gb": round(max(peaks), 2) if peaks[0] is not None else None, "compile": compiled,
            "compiled_graphs": compile_stats()[0], **memory_setting(b)}


def bench_grpo(shape: str, b: argparse.Namespace, device: torch.device) -> dict:
    cfg = shape_config(shape, b.vintage)
    G, n, P, L = b.group_size, b.grpo_prompts, b.prompt_len, b.new_tokens
    policy = make_backbone(cfg, device, 0)
    model = CompletionLogprobs(policy)
    if b.lora_r:  # as the trainer: adapters train, the base held as the reference would be and is the reference
        apply_lora(policy, LoraSpec(b.lora_r, 2.0 * b.lora_r))
        hold_frozen_in(policy, torch.bfloat16, matmuls_only=True)
        reference = WithoutAdapters(model, policy)
    else:
        reference = reference_model(make_backbone(cfg, device, 0), torch.bfloat16,
                                    matmuls_only=b.par is None or b.par.gathers_in is None)
    rm_model = RewardModel(make_backbone(cfg, device, 1)).to(device).requires_grad_(False)
    hold_frozen_in(rm_model.backbone, torch.bfloat16)
    scorer = RewardScorer(rm_model, types.SimpleNamespace(pad_id=0), cfg.sequence_len, {}, torch.bfloat16)
    compiled = compile_models(b.compile, device, policy, None if b.lora_r else reference.backbone, rm_model.backbone)
    # --compile auto decides the engine for a run of --run_steps steps (what a training run decodes), not the bench's few
    engine = Engine(policy, compile=decode_compiled(b.compile, device, b.run_steps, L)[0], logprobs=True,
                    end_check_every=b.end_check_every, whole_in=(b.par.gathers_in or torch.float32) if b.par else None)
    shard(model, policy, b)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_adamw(trainable, 1e-6, 0.0, device)
    stop = cfg.vocab_size - 1
    sampling = SamplingConfig(max_new_tokens=L, temperature=1.0, min_new_tokens=L)  # every completion runs L tokens
    loss_cfg = LossConfig("token", 0.2, None, 0.04, L)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, stop, (P,), generator=g).tolist() for _ in range(n)]
    # The first warm-up step's prompts are 16 tokens shorter, for the reason bench_rm gives.
    warm_prompts = [p[min(16, P // 2):] for p in prompts]
    phases = {"generation": [], "scoring": [], "reference": [], "training": []}
    peaks = dict.fromkeys(phases, 0.0)
    decoded, engine_sums = [], torch.zeros(4, dtype=torch.float64)  # LOSS_STATS' engine_* over the timed steps
    for step in range(b.warmup + b.steps):
        clocks = {}
        with Clock(device) as clocks["generation"], autocast_for(device):
            policy.eval()
            step_prompts = warm_prompts if step == 0 and b.warmup else prompts
            samples = engine.generate(step_prompts, G, sampling, stop, 0,
                                      [torch.Generator().manual_seed(1000 * step + i) for i in range(n)])
        with Clock(device) as clocks["scoring"]:
            rewards = torch.tensor(scorer.score_ids([step_prompts[i // G] + c for i, c in enumerate(samples.completions)],
                                                    batch_size=b.micro, group=G), dtype=torch.float64)
        # As the trainer batches them: a group's prompt shared (prefix-tree rows) where micro-batches hold whole groups
        batch = make_sequences(step_prompts, samples.completions, G, 0, share_prompt=b.micro % G == 0)
        batch["advantages"] = group_advantages(rewards, G, "group")
        batch["weights"] = torch.ones(n * G)
        batch["engine_logp"] = per_token(samples.logprobs, batch["target"].shape)  # train/engine_ratio, as GRPO logs
        with Clock(device) as clocks["reference"]:
            batch["ref_logp"] = token_logprobs(reference, batch, b.micro, device, autocast_for(device))
        with Clock(device) as clocks["training"]:
            stats = policy_backward(model, batch, b.micro, loss_cfg, device, autocast_for(device))
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if step >= b.warmup:
            decoded.append(engine.last)
            engine_sums += stats[LOSS_STATS.index("engine_ratio"):]
            for k, c in clocks.items():
                phases[k].append(c.s)
                peaks[k] = max(peaks[k], c.peak_gb or 0.0)
    s = {k: sum(v) / len(v) for k, v in phases.items()}
    T = P + L
    completions = n * G
    train_flops = (completions * T * 3 * block_fwd_flops(cfg, list(policy.blocks), T)
                   + completions * L * 6 * cfg.n_embd * cfg.vocab_size)
    peak = peak_tflops(device, b.peak_tflops)
    step_s = sum(s.values())
    return {"bench": "gpu_grpo", "shape": shape, "vintage": b.vintage, "prompts": n, "group_size": G, "prompt_len": P, "new_tokens": L,
            "micro_batch": b.micro, "params": sum(p.numel() for p in trainable),
            "s_per_step": round(step_s, 3), **{f"s_{k}": round(v, 3) for k, v in s.items()},
            "completions_per_s": round(completions / step_s, 2),
            "gen_tokens_per_s": round(completions * L / s["generation"], 1),
            "train_tokens_per_s": round(completions * T / s["training"], 1),
            "train_tflops": round(train_flops / s["training"] / 1e12, 3),
            "train_mfu": round(train_flops / s["training"] / 1e12 / peak, 4) if peak else None,
            "peak_mem_gb": {k: round(v, 2) for k, v in peaks.items()} if device.type == "cuda" else None,
            **decode_figures(decoded, device), "decode_compiled": engine.compiled,
            # the trainer's log-probs against the engine's (its bf16 copy, its CUDA graphs): GRPO's train/engine_*
            **{k: round(float(v / max(engine_sums[3], 1)), 6) for k, v in zip(
                ("engine_ratio", "engine_logp_diff", "engine_far"), engine_sums[:3])},
            "compile": compiled, "compiled_graphs": compile_stats()[0], **memory_setting(b)}


def shard(model: torch.nn.Module, backbone: Backbone, b: argparse.Namespace) -> None:
    """--activation_checkpointing and --parallel fsdp (one rank) as the trainers apply them."""
    if b.activation_checkpointing:
        checkpoint_activations(backbone.blocks)
    if b.par is not None:
        b.par.wrap(model, backbone.blocks)


def memory_setting(b: argparse.Namespace) -> dict:
    return {"parallel": "fsdp" if b.par else "none", "activation_checkpointing": b.activation_checkpointing,
            "lora_r": b.lora_r}


def decode_figures(runs: list, device: torch.device) -> dict:
    """Decoding over the engine's timed calls, as nanochat's infer_bench reports it: rows x steps per second of
    decode steps, and MBU (the bytes those steps must read, over the device's peak bandwidth)."""
    s = sum(r.decode_s for r in runs)
    bw = peak_bandwidth(device)
    return {"decode_tok_per_s": round(sum(r.rows * r.steps for r in runs) / s, 1) if s > 0 else None,
            "decode_mbu": round(sum(r.bytes_read for r in runs) / s / bw, 4) if bw and s > 0 else None,
            "prefill_s": round(sum(r.prefill_s for r in runs) / len(runs), 4)}


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
        rows.append({"bench": "gpu_optimizer", "shape": shape, "optimizer": kind, "params": sum(p.numel() for p in params),
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
    p.add_argument("--only", choices=("rm", "grpo", "decode", "optim", "both", "all"), default="all",
                   help="which benches (both: rm and grpo, as before the decode bench; optim: one step of "
                        "--optimizer adamw and muon)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per measurement")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--run_steps", type=int, default=500,
                   help="the GRPO run --compile auto decides the engine for (its --max_steps; the README's stages: 500)")
    p.add_argument("--rm_pairs", type=int, default=32, help="pairs per RM step")
    p.add_argument("--rm_len", type=int, default=512, help="tokens per RM sequence")
    p.add_argument("--grpo_prompts", type=int, default=16, help="prompts per GRPO step (x group_size completions)")
    p.add_argument("--group_size", type=int, default=16)
    p.add_argument("--prompt_len", type=int, default=128)
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--micro", type=int, default=64, help="sequences per forward in scoring / reference / training")
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
