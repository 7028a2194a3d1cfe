"""The trainers' steps as bench_gpu.py measures them: the reward model's, GRPO's and DPO's, each through the library's
own step function on a random nanochat-shaped model (gpu_measure.py: shapes, FLOPs, clocks). A JSON-ready dict each.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_measure import Clock, autocast_for, block_fwd_flops, decode_figures, make_backbone, peak_tflops, shape_config

from nanochat_ext.algorithms.advantages import group_advantages
from nanochat_ext.algorithms.dpo import DPOConfig, dpo_backward, pair_sequences, reference_logps
from nanochat_ext.algorithms.grpo import LOSS_STATS, LossConfig, per_token, policy_backward
from nanochat_ext.algorithms.rm import rm_backward
from nanochat_ext.algorithms.rollout_batch import RolloutBatch
from nanochat_ext.data.batching import TokenizedPair
from nanochat_ext.engine.cost import decode_compiled
from nanochat_ext.engine.engine import Engine
from nanochat_ext.engine.sampling import SamplingConfig
from nanochat_ext.models.backbone import Backbone, hold_frozen_in
from nanochat_ext.models.compiled import compile_models, compile_stats
from nanochat_ext.models.lora import LoraSpec, WithoutAdapters, apply_lora
from nanochat_ext.models.reward_model import RewardModel, RewardScorer
from nanochat_ext.runtime.parallel import checkpoint_activations
from nanochat_ext.training.logprobs import CompletionLogprobs, make_sequences, reference_model, token_logprobs
from nanochat_ext.training.optim import make_adamw


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
    # The first warm-up step is 64 tokens shorter: compiled, a new length makes torch recompile with symbolic
    # sizes, so the timed steps run the graph that ragged training runs, not one specialised to T.
    cut = T - min(64, T // 2)
    short = {**batch, "input_ids": batch["input_ids"][:, :cut], "lengths": torch.full((2 * n,), cut)}
    s, peak_gb = timed_steps(lambda warm: rm_backward(model, [short if warm else batch], "mean", None, device,
                                                      autocast_for(device)), trainable, optimizer, b, device)
    trainable_blocks = [blk for blk in backbone.blocks if any(p.requires_grad for p in blk.parameters())]
    flops = 2 * n * T * (block_fwd_flops(cfg, list(backbone.blocks), T) + 2 * block_fwd_flops(cfg, trainable_blocks, T))
    peak = peak_tflops(device, b.peak_tflops)
    return {"bench": "gpu_rm", "shape": shape, "vintage": b.vintage, "unfreeze_last": unfreeze,
            "pairs_per_step": n, "seq_len": T,
            "params": sum(p.numel() for p in model.parameters()), "trainable": sum(p.numel() for p in trainable),
            "ms_per_step": round(1000 * s, 2), "pairs_per_s": round(n / s, 2), "tokens_per_s": round(2 * n * T / s, 1),
            "tflops": round(flops / s / 1e12, 3), "mfu": round(flops / s / 1e12 / peak, 4) if peak else None,
            "peak_mem_gb": peak_gb, "compile": compiled,
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
    # --compile auto decides the engine for a run of --run_steps steps (what a training run decodes),
    # not the bench's few
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
            rewards = torch.tensor(scorer.score_ids([step_prompts[i // G] + c
                                                     for i, c in enumerate(samples.completions)],
                                                    batch_size=b.micro, group=G), dtype=torch.float64)
        # As the trainer batches them: a group's prompt shared (prefix-tree rows) where micro-batches hold whole groups
        batch = make_sequences(step_prompts, samples.completions, G, 0, share_prompt=b.micro % G == 0)
        batch = RolloutBatch.of(batch, advantages=group_advantages(rewards, G, "group"), weights=torch.ones(n * G))
        batch.engine_logp = per_token(samples.logprobs, batch.target.shape)  # train/engine_ratio, as GRPO logs
        with Clock(device) as clocks["reference"]:
            batch.ref_logp = token_logprobs(reference, batch, b.micro, device, autocast_for(device))
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
    return {"bench": "gpu_grpo", "shape": shape, "vintage": b.vintage, "prompts": n, "group_size": G,
            "prompt_len": P, "new_tokens": L,
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


def bench_dpo(shape: str, b: argparse.Namespace, device: torch.device) -> dict:
    """DPO's step as kat_train_dpo takes it (sigmoid loss, beta 0.1): dpo_pairs pairs of a prompt_len-token prompt
    and two dpo_len-token responses (random ids), a pair's prompt computed once, the reference's log-probs in the step
    (not precomputed), AdamW, bf16 autocast."""
    cfg = shape_config(shape, b.vintage)
    n, P, R = b.dpo_pairs, b.prompt_len, b.dpo_len
    policy = make_backbone(cfg, device, 0)
    model = CompletionLogprobs(policy)
    reference = reference_model(make_backbone(cfg, device, 0), torch.bfloat16,
                                matmuls_only=b.par is None or b.par.gathers_in is None)
    compiled = compile_models(b.compile, device, policy, reference.backbone)
    shard(model, policy, b)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_adamw(trainable, 1e-6, 0.0, device)
    g = torch.Generator().manual_seed(0)
    ids = lambda k: torch.randint(0, cfg.vocab_size - 1, (k,), generator=g).tolist()  # noqa: E731
    pairs = []
    for _ in range(n):
        prompt = ids(P)
        pairs.append(TokenizedPair(prompt + ids(R), prompt + ids(R), 1.0, prompt_len=P))
    batch = pair_sequences(pairs, 0)
    # The first warm-up step's responses are 16 tokens shorter, for the reason bench_rm gives.
    cut = min(16, R // 2)
    short = pair_sequences([TokenizedPair(p.chosen[:-cut], p.rejected[:-cut], 1.0, prompt_len=P) for p in pairs], 0)
    cfg_dpo = DPOConfig()
    micro = 2 * b.dpo_micro  # sequences: a pair's two responses
    def step(warm: bool) -> None:
        step_batch = dataclasses.replace(short if warm else batch)
        step_batch.ref = reference_logps(reference, step_batch, micro, device, autocast_for(device))
        dpo_backward(model, step_batch, micro, cfg_dpo, device, autocast_for(device))

    s, peak_gb = timed_steps(step, trainable, optimizer, b, device)
    computed = float(batch.computed.sum())
    flops = (computed * 4 * block_fwd_flops(cfg, list(policy.blocks), P + R)
             + 2 * n * R * 8 * cfg.n_embd * cfg.vocab_size)
    peak = peak_tflops(device, b.peak_tflops)
    return {"bench": "gpu_dpo", "shape": shape, "vintage": b.vintage, "pairs_per_step": n, "prompt_len": P,
            "response_len": R, "micro_pairs": b.dpo_micro, "params": sum(p.numel() for p in trainable),
            "ms_per_step": round(1000 * s, 2), "pairs_per_s": round(n / s, 2),
            "tokens_per_s": round(computed / s, 1), "tflops": round(flops / s / 1e12, 3),
            "mfu": round(flops / s / 1e12 / peak, 4) if peak else None,
            "peak_mem_gb": peak_gb, "compile": compiled,
            "compiled_graphs": compile_stats()[0], **memory_setting(b)}


def timed_steps(backward, trainable: list, optimizer, b: argparse.Namespace, device: torch.device
                ) -> tuple[float, float | None]:
    """warmup + steps optimizer steps, each backward(warm) (warm: the first warm-up step, which runs a shorter batch),
    gradient clipping at 1 and AdamW: (mean seconds of the timed steps, their peak GB on CUDA, else None)."""
    times, peaks = [], []
    for step in range(b.warmup + b.steps):
        with Clock(device) as c:
            backward(step == 0 and b.warmup > 0)
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if step >= b.warmup:
            times.append(c.s)
            peaks.append(c.peak_gb)
    return sum(times) / len(times), round(max(peaks), 2) if peaks[0] is not None else None


def shard(model: torch.nn.Module, backbone: Backbone, b: argparse.Namespace) -> None:
    """--activation_checkpointing and --parallel fsdp (one rank) as the trainers apply them."""
    if b.activation_checkpointing:
        checkpoint_activations(backbone.blocks)
    if b.par is not None:
        b.par.wrap(model, backbone.blocks)


def memory_setting(b: argparse.Namespace) -> dict:
    return {"parallel": "fsdp" if b.par else "none", "activation_checkpointing": b.activation_checkpointing,
            "lora_r": b.lora_r}

