"""One file per method: the reward model's loss, DPO, GRPO with its rewards, rollouts and evaluation."""
