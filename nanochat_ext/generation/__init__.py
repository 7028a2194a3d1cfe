"""Decoding: the rollout engine, its sampling rules and the tools that run inside rollouts."""
