"""Tasks with answers to check: rule-based rewards, word arithmetic, the demo's synthetic domain, its statistics."""
