"""The models: nanochat's GPT in every vintage, native Llama, any transformers causal LM, LoRA, the reward model."""
