"""The rollout engine: sampling rules, tokens forced into rows,
the runners (eager, compiled) and the one decode loop."""
