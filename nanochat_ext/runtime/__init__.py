"""What every run stands on: the stop guard, checkpoints, --out, --resume, --parallel, a lost rank."""
