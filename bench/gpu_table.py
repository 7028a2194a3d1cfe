"""The short table at the end of bench/run_gpu.sh: one row per shape from its JSON lines (bench_gpu.py's,
trl_gpu.py's and the CUDA tests' summary), in the layout of the GPU baseline's table.

    python bench/gpu_table.py bench/results/gpu_<time>.jsonl
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

HEADER = ("| shape | RM frozen pairs/s (MFU) | RM last 2 | RM full (peak GB) | GRPO completions/s ours / TRL | "
          "GRPO s/step gen / score / ref / train | GRPO train MFU; peak GB | DPO pairs/s ours (MFU) / TRL | "
          "decode tok/s ours eager / +tools / compiled / +tools / nanochat (MBU) | optimizer step ms adamw / muon |")


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def rm_cell(r: dict | None, peak: bool = False) -> str:
    if r is None:
        return "-"
    extra = f", {r['peak_mem_gb']}" if peak and r.get("peak_mem_gb") is not None else ""
    return f"{r['pairs_per_s']} ({pct(r['mfu'])}{extra})"


def decode_cell(r: dict | None) -> str:
    if r is None:
        return "-"
    return f"{r['decode_tok_per_s']}" + (f" ({pct(r['decode_mbu'])})" if r.get("decode_mbu") is not None else "")


def label(r: dict) -> str:
    """The table row a figure belongs to: its shape, and the memory setting it ran under (FSDP, LoRA, activation
    checkpointing) where it is not the plain one."""
    fsdp = " fsdp" if r.get("parallel", "none") != "none" else ""
    lora = f" LoRA r{r['lora_r']}" if r.get("lora_r") else ""
    return r["shape"] + fsdp + lora + (" +AC" if r.get("activation_checkpointing") else "")


def table(rows: list[dict]) -> str:
    """Markdown: the CUDA tests' summary, then a row per shape and setting in the order they were measured."""
    tests = [r["summary"] for r in rows if r.get("bench") == "cuda_tests"]
    shapes = list(dict.fromkeys(label(r) for r in rows if "shape" in r))
    lines = [f"CUDA tests: {tests[-1] if tests else 'not run'}", "", HEADER, "|---" * 10 + "|"]
    for shape in shapes:
        rm = {r["unfreeze_last"]: r for r in rows if r.get("bench") == "gpu_rm" and label(r) == shape}
        ours = next((r for r in rows if r.get("bench") == "gpu_grpo" and label(r) == shape), None)
        trl = next((r for r in rows if r.get("bench") == "trl_gpu_grpo" and label(r) == shape), None)
        ratio = f" ({ours['completions_per_s'] / trl['completions_per_s']:.2f}x)" if ours and trl else ""
        grpo = f"{ours['completions_per_s'] if ours else '-'} / {trl['completions_per_s'] if trl else '-'}{ratio}"
        phases, train = "-", "-"
        if ours:
            phases = " / ".join(str(ours[f"s_{k}"]) for k in ("generation", "scoring", "reference", "training"))
            peak = (ours.get("peak_mem_gb") or {}).get("training")
            train = f"{pct(ours['train_mfu'])}; {'-' if peak is None else peak}"
        dpo = next((r for r in rows if r.get("bench") == "gpu_dpo" and label(r) == shape), None)
        trl_dpo = next((r for r in rows if r.get("bench") == "trl_gpu_dpo" and label(r) == shape), None)
        dpo_ratio = f" ({dpo['pairs_per_s'] / trl_dpo['pairs_per_s']:.2f}x)" if dpo and trl_dpo else ""
        dpos = f"{rm_cell(dpo)} / {trl_dpo['pairs_per_s'] if trl_dpo else '-'}{dpo_ratio}"
        rms = " | ".join((rm_cell(rm.get("0")), rm_cell(rm.get("2")), rm_cell(rm.get("all"), peak=True)))
        decode = {r["engine"]: r for r in rows if r.get("bench") == "gpu_decode" and label(r) == shape}
        decodes = " / ".join(decode_cell(decode.get(e)) for e in ("ours eager", "ours eager +tools", "ours compiled",
                                                                  "ours compiled +tools", "nanochat"))
        steps = {r["optimizer"]: r["ms_per_step"]
                 for r in rows if r.get("bench") == "gpu_optimizer" and label(r) == shape}
        optim = " / ".join(str(steps.get(k, "-")) for k in ("adamw", "muon"))
        lines.append(f"| {shape} | {rms} | {grpo} | {phases} | {train} | {dpos} | {decodes} | {optim} |")
    return "\n".join(lines)


def real_model(rows: list[dict]) -> list[str]:
    """run_gpu.sh's REAL_SHAPE figures: GRPO on SmolLM2's shape, ours beside TRL's, where measured."""
    ours = next((r for r in rows if r.get("bench") == "nanochat_ext_grpo"), None)
    trl = next((r for r in rows if r.get("bench") == "trl_real_model_throughput"), None)
    if ours is None and trl is None:
        return []
    cell = lambda r: "-" if r is None else f"{r['completions_per_s']}"  # noqa: E731
    ratio = f"{ours['completions_per_s'] / trl['completions_per_s']:.2f}x" if ours and trl else "-"
    return ["", "SmolLM2-135M's shape, random weights (GRPO, 1 prompt x 8 completions x 32 tokens):", "",
            "| completions/s | ours | TRL | ours / TRL |", "|---|---|---|---|",
            f"| GRPO | {cell(ours)} | {cell(trl)} | {ratio} |"]


def main() -> None:
    path = Path(sys.argv[1])
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.startswith('{"bench"')]
    print("\n".join([table(rows)] + real_model(rows)))


if __name__ == "__main__":
    main()
