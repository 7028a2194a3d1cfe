"""Rollouts as conversations: nanochat's calculator, your tools and environments,
the episodes the engine hands each step."""
