"""Hugging Face TRL's GRPOTrainer (or, with --trainer dpo, its DPOTrainer) at bench_gpu.py's settings, on a Llama of
the same size: the peer figure for GRPO completions/s (DPO pairs/s) on a GPU. One JSON line.

Same as bench_gpu.py's GRPO: 16 prompts of 128 random tokens x 16 completions of exactly 256 new tokens
(min_new_tokens), a reward model of the policy's size (random), beta 0.04 (reference model), micro-
batches of 64 sequences (TRL: per_device_train_batch_size 64, 4 accumulation steps = one generation
batch of 256), bf16 on CUDA, transformers' generate (no vLLM). The Llama has nanochat dN's width, depth,
heads, 4x MLP and vocabulary (gpu_measure.nanochat_dims).
It needs trl, transformers, accelerate and datasets (bench/run_gpu.sh).

DPO as bench_gpu.py's: 32 pairs a step of a 128-token prompt and two 256-token responses (random words; TRL appends
an EOS to each), sigmoid loss, beta 0.1, the reference's log-probs in the step, 8 pairs a forward (4 accumulation
steps), lr 1e-6.

    python bench/trl_gpu.py --shape d20
    python bench/trl_gpu.py --shape d20 --trainer dpo
    python bench/trl_gpu.py --shape tiny --device cpu --steps 1 --warmup 0    # smoke test
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from gpu_measure import nanochat_dims  # noqa: E402  (bench/ is on the path: run as a script)
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
    TrainerCallback,
    set_seed,
)
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer  # noqa: E402


def llama_config(shape: str) -> LlamaConfig:
    depth, width, heads, vocab = nanochat_dims(shape)
    return LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=depth,
                       num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=2048,
                       tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def word_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """Token i is the word 't<i>': a prompt of k random words is exactly k tokens."""
    words = {f"t{i}": i for i in range(vocab)}
    bpe = Tokenizer(models.WordLevel(words, unk_token="t3"))
    bpe.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="t0", bos_token="t1", eos_token="t2", unk_token="t3")
    tok.padding_side = "left"
    return tok


class StepClock(TrainerCallback):
    def __init__(self):
        self.starts, self.ends = [], []

    def on_step_begin(self, args, state, control, **kw):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.starts.append(time.perf_counter())

    def on_step_end(self, args, state, control, **kw):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())


class TimedGRPO(GRPOTrainer):
    """Wall time of each rollout (generation + reward + reference) and of generate() within it."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.gen_s, self.rollout_s = [], []

    def _generate_single_turn(self, *a, **kw):
        t = time.perf_counter()
        out = super()._generate_single_turn(*a, **kw)
        self.gen_s.append(time.perf_counter() - t)
        return out

    def _generate_and_score_completions(self, inputs):
        t = time.perf_counter()
        out = super()._generate_and_score_completions(inputs)
        self.rollout_s.append(time.perf_counter() - t)
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="d20")
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group_size", type=int, default=16)
    p.add_argument("--prompt_len", type=int, default=128)
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--micro", type=int, default=64)
    p.add_argument("--trainer", choices=("grpo", "dpo"), default="grpo")
    p.add_argument("--dpo_pairs", type=int, default=32)
    p.add_argument("--dpo_len", type=int, default=256)
    p.add_argument("--dpo_micro", type=int, default=8)
    b = p.parse_args()
    set_seed(0)
    cfg = llama_config(b.shape)
    cuda = b.device == "cuda"
    tok = word_tokenizer(cfg.vocab_size)
    if b.trainer == "dpo":
        return dpo(b, cfg, tok, cuda)
    # TRL builds its reference model from the policy's path: save the random models, load them back.
    models_dir = tempfile.mkdtemp(prefix="trl_gpu_models_")
    LlamaForCausalLM(cfg).save_pretrained(f"{models_dir}/policy")
    LlamaForSequenceClassification(LlamaConfig(**{**cfg.to_dict(),
                                                  "num_labels": 1})).save_pretrained(f"{models_dir}/rm")
    policy = LlamaForCausalLM.from_pretrained(f"{models_dir}/policy")
    rm = LlamaForSequenceClassification.from_pretrained(f"{models_dir}/rm")
    g = torch.Generator().manual_seed(0)
    prompts = [" ".join(f"t{int(i)}" for i in torch.randint(4, cfg.vocab_size, (b.prompt_len,), generator=g))
               for _ in range(b.prompts * (b.warmup + b.steps))]
    completions_per_step = b.prompts * b.group_size
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_gpu_"), per_device_train_batch_size=b.micro,
        gradient_accumulation_steps=completions_per_step // b.micro, num_generations=b.group_size,
        max_completion_length=b.new_tokens, generation_kwargs={"min_new_tokens": b.new_tokens}, temperature=1.0,
        beta=0.04, learning_rate=1e-6, max_steps=b.warmup + b.steps, use_vllm=False, bf16=cuda, use_cpu=not cuda,
        logging_strategy="no", save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
        seed=0)
    clock = StepClock()
    trainer = TimedGRPO(model=policy, reward_funcs=rm, reward_processing_classes=tok, args=args,
                        train_dataset=Dataset.from_list([{"prompt": q} for q in prompts]), processing_class=tok,
                        callbacks=[clock])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    w = b.warmup
    step_s = [e - s for s, e in zip(clock.starts, clock.ends)][w:]
    secs = sum(step_s)
    gen_s, roll_s = sum(trainer.gen_s[w:]), sum(trainer.rollout_s[w:])
    n = b.steps * completions_per_step
    print(json.dumps({
        "bench": "trl_gpu_grpo", "shape": b.shape, "params": sum(q.numel() for q in policy.parameters()),
        "prompts": b.prompts, "group_size": b.group_size, "prompt_len": b.prompt_len, "new_tokens": b.new_tokens,
        "micro_batch": b.micro, "s_per_step": round(secs / b.steps, 3), "s_generation": round(gen_s / b.steps, 3),
        "s_scoring_and_reference": round((roll_s - gen_s) / b.steps, 3),
        "s_training": round((secs - roll_s) / b.steps, 3), "completions_per_s": round(n / secs, 2),
        "gen_tokens_per_s": round(n * b.new_tokens / gen_s, 1),
        "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        **versions(cuda)}), flush=True)


def versions(cuda: bool) -> dict:
    return {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
            "trl": __import__("trl").__version__, "transformers": __import__("transformers").__version__}


def dpo(b: argparse.Namespace, cfg: LlamaConfig, tok: PreTrainedTokenizerFast, cuda: bool) -> None:
    """TRL's DPOTrainer at bench_gpu.py's DPO settings: its pairs/s over the timed steps."""
    path = f"{tempfile.mkdtemp(prefix='trl_gpu_models_')}/policy"  # its reference is built from the policy's path
    LlamaForCausalLM(cfg).save_pretrained(path)
    policy = LlamaForCausalLM.from_pretrained(path)
    g = torch.Generator().manual_seed(0)
    words = lambda k: " ".join(f"t{int(i)}" for i in torch.randint(4, cfg.vocab_size, (k,), generator=g))  # noqa: E731
    rows = [{"prompt": words(b.prompt_len), "chosen": words(b.dpo_len), "rejected": words(b.dpo_len)}
            for _ in range(b.dpo_pairs * (b.warmup + b.steps))]
    args = DPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_gpu_dpo_"), per_device_train_batch_size=b.dpo_micro,
        gradient_accumulation_steps=b.dpo_pairs // b.dpo_micro, beta=0.1, loss_type="sigmoid", learning_rate=1e-6,
        max_length=b.prompt_len + b.dpo_len + 2, max_steps=b.warmup + b.steps, bf16=cuda, use_cpu=not cuda,
        precompute_ref_log_probs=False, logging_strategy="no", save_strategy="no", eval_strategy="no",
        report_to="none", disable_tqdm=True, seed=0)
    clock = StepClock()
    trainer = DPOTrainer(model=policy, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                         callbacks=[clock])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    secs = sum(e - s for s, e in list(zip(clock.starts, clock.ends))[b.warmup:])
    print(json.dumps({
        "bench": "trl_gpu_dpo", "shape": b.shape, "params": sum(q.numel() for q in policy.parameters()),
        "pairs_per_step": b.dpo_pairs, "prompt_len": b.prompt_len, "response_len": b.dpo_len,
        "micro_pairs": b.dpo_micro, "ms_per_step": round(1000 * secs / b.steps, 2),
        "pairs_per_s": round(b.steps * b.dpo_pairs / secs, 2),
        "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None, **versions(cuda)}),
        flush=True)


if __name__ == "__main__":
    main()
