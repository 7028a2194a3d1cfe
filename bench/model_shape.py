"""A Hugging Face model's shape without its weights, and random weights of that shape: how the real model's speed
reaches a GPU machine that has no network and takes 64 MiB with the checkout (SmolLM2-135M's fp32 weights are 538 MB;
its config, generation config and tokenizer are 4 MB). Speed does not depend on the weights' values where the
completions' lengths are fixed, as the throughput benches fix them.

    python bench/model_shape.py strip MODEL_DIR SHAPE_DIR   # everything but the weights (here)
    python bench/model_shape.py fill SHAPE_DIR MODEL_DIR    # random weights of that config, seeded (there)
"""
import argparse
import shutil
import sys
from pathlib import Path

WEIGHTS = (".safetensors", ".bin", ".pt", ".gguf")


def strip(src: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(WEIGHTS) and not f.name.endswith(".index.json"):
            shutil.copy2(f, out / f.name)


def fill(shape: Path, out: Path, seed: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shape), dtype=torch.float32)
    model.save_pretrained(out)
    for f in shape.iterdir():  # the tokenizer and generation config, as they were
        if f.is_file() and not (out / f.name).exists():
            shutil.copy2(f, out / f.name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("strip", "fill"))
    p.add_argument("src")
    p.add_argument("out")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    src, out = Path(a.src), Path(a.out)
    if not (src / "config.json").is_file():
        sys.stderr.write(f"error: {src}: no config.json (a Hugging Face model dir or a shape made by strip)\n")
        return 2
    strip(src, out) if a.mode == "strip" else fill(src, out, a.seed)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
