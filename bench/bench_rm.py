"""Training throughput on preference pairs of scripts/kat_train_rm, or with --trainer dpo of scripts/kat_train_dpo
(the real trainers, in-process), printed as one JSON line. Defaults match ../shared/anchor-bench/trl_rm.py: 16
pairs per process per step, max_len 128, AdamW lr 1e-4 (DPO: 1e-6, TRL's), grad clip 1, fp32, 60 steps of which
the first 5 are not timed. DPO's peer is bench/trl_dpo.py (sigmoid loss, beta 0.1, reference on the fly).

    python bench/bench_rm.py --backbone ASSETS/tiny-llama --pairs ASSETS/pairs.jsonl --threads 2
    torchrun --standalone --nproc_per_node 2 bench/bench_rm.py --backbone ... --pairs ... --threads 1
    --unfreeze_last all  : full fine-tune (what TRL's RewardTrainer does);  0 (default): frozen backbone
    --trainer dpo        : DPO of the whole model (--backbone is the policy)

tokens_per_s counts each pair's tokens as two sequences (what TRL's batches hold); computed_tokens_per_s
counts the tokens the model ran, each pair's shared prompt once (see batching.collate_pairs).
gflops: the nominal model FLOPs per second of the full fine-tune, 6 x (matmul weights in the blocks) per
computed token (forward 2, backward 4), as MFU is usually counted (attention scores, a few % at these
lengths, and the savings of running the last block at the scored position only are not counted); DPO's 8 x: its
reference's forward too.
Compare it with bench/matmul_peak.py's plain-torch fp32 matmul peak in the same sitting.
"""
import argparse
import json
import os
import resource
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainer", choices=("rm", "dpo"), default="rm")
    p.add_argument("--backbone", required=True)
    p.add_argument("--pairs", required=True)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads per process")
    p.add_argument("--unfreeze_last", default="0")
    p.add_argument("--pairs_per_proc", type=int, default=16)
    p.add_argument("--device_batch_size", type=int, default=None,
                   help="pairs per micro-batch (default: all of a rank's)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5, help="leading steps left out of the timing")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"), help="kat_train_rm --dtype")
    b = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(b.threads)
    import torch

    torch.set_num_threads(b.threads)
    from nanochat_ext.ddp_common import all_reduce_max, dist_session
    from nanochat_ext.runtime.progress import Progress
    from nanochat_ext.runtime.session import Session
    from scripts import kat_train_dpo, kat_train_rm

    world = int(os.environ.get("WORLD_SIZE", 1))
    out = tempfile.mkdtemp(prefix=f"bench_{b.trainer}_")
    trainer = kat_train_rm if b.trainer == "rm" else kat_train_dpo
    argv = ["--pairs", b.pairs, "--batch_size", str(b.pairs_per_proc * world),
            "--max_steps", str(b.steps), "--log_every", str(b.warmup), "--eval_every", "0", "--val_ratio", "0",
            "--max_len", "128", "--grad_clip", "1.0", "--device", b.device, "--dtype", b.dtype, "--out", out]
    if b.trainer == "rm":
        argv += ["--backbone", b.backbone, "--lr", "1e-4", "--unfreeze_last", b.unfreeze_last]
    else:
        argv += ["--policy", b.backbone, "--lr", "1e-6", "--beta", "0.1"]
    if b.tokenizer:
        argv += ["--tokenizer", b.tokenizer]
    if b.device_batch_size:
        argv += ["--device_batch_size", str(b.device_batch_size)]
    args = trainer.parse_args(argv)
    with dist_session(args.device) as env:
        trainer.train(args, Session(env, Progress()))
        rss_mb = all_reduce_max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        if not env.is_main:
            return
        logs = [json.loads(line) for line in open(Path(out) / "logs" / "metrics.jsonl")]
        windows = [r for r in logs if "perf/pairs_per_s" in r and r["step"] > b.warmup]
        # each window's steps: --steps need not be a multiple of --warmup (the log interval), so the last may be short
        sizes = [r["step"] - prev for r, prev in zip(windows, [b.warmup] + [r["step"] for r in windows])]
        per_window = [n * b.pairs_per_proc * world for n in sizes]
        secs = sum(p / r["perf/pairs_per_s"] for p, r in zip(per_window, windows))
        tokens, computed = (sum(r[key] * p / r["perf/pairs_per_s"] for p, r in zip(per_window, windows))
                            for key in ("perf/tokens_per_s", "perf/computed_tokens_per_s"))
        pairs = sum(per_window)
        from nanochat_ext.models.loader import load_backbone

        blocks = load_backbone(b.backbone).blocks
        matmul_params = sum(m.weight.numel() for m in blocks.modules() if isinstance(m, torch.nn.Linear))
        print(json.dumps({
            "bench": f"nanochat_ext_{b.trainer}", "unfreeze_last": b.unfreeze_last if b.trainer == "rm" else "all",
            "dtype": b.dtype, "world_size": env.world_size,
            "threads_per_proc": torch.get_num_threads(), "pairs_per_step_global": b.pairs_per_proc * world,
            "steps_timed": sum(sizes), "timed_s": round(secs, 3),
            "pairs_per_s": round(pairs / secs, 2), "tokens_per_s": round(tokens / secs, 1),
            "computed_tokens_per_s": round(computed / secs, 1),
            "mean_seq_len": round(tokens / (2 * pairs), 1), "ms_per_step": round(1000 * secs / sum(sizes), 2),
            "gflops_full_ft_nominal": round((6 if b.trainer == "rm" else 8) * matmul_params * computed / secs / 1e9, 2)
            if b.unfreeze_last == "all" or b.trainer == "dpo" else None,
            "peak_rss_mb_max_proc": round(rss_mb, 1), "torch": torch.__version__,
        }), flush=True)


if __name__ == "__main__":
    main()
