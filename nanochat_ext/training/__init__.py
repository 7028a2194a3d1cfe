"""What every trainer shares: completion log-probs, optimizers, the memory model, logs, the loop and its setup."""
