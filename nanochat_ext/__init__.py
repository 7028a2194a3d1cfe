"""nanochat_ext: reward-model and GRPO training for nanochat-style chat models, DDP-correct."""
