"""nanochat_ext: reward models, GRPO, DPO and SFT for nanochat-style chat models, DDP-correct."""
