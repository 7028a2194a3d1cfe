"""Started on gloo ranks by tests/test_fsdp.py: what FSDP gathers, counted by torch's profiler (FSDP2 names each
all-gather `FSDP::all_gather (<module>)`). One GRPO step of nanochat's current vintage under --parallel fsdp in 3
accumulated micro-batches, and the rollout engine's refresh of its whole bf16 copy from the shards. Prints one JSON
line per rank, from rank 0."""
import json
import random
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from nanochat_ext import ddp_common as dc
from nanochat_ext.algorithms.grpo import LossConfig, policy_backward
from nanochat_ext.algorithms.rollout_batch import RolloutBatch
from nanochat_ext.engine.engine import Engine
from nanochat_ext.models.loader import load_backbone
from nanochat_ext.runtime.parallel import Parallel
from nanochat_ext.training.logprobs import CompletionLogprobs, make_sequences


def main(policy_dir: str) -> None:
    torch.set_num_threads(1)
    with dc.dist_session("cpu", "gloo") as env:
        policy = load_backbone(Path(policy_dir))
        policy.set_trainable("all")
        engine = Engine(policy, whole_in=torch.bfloat16)  # before sharding, as the trainer makes it
        model = CompletionLogprobs(policy)
        parallel = Parallel("fsdp", env, torch.float32)
        wrapped = parallel.wrap(model, policy.blocks)
        rng = random.Random(env.rank)
        prompts = [[rng.randrange(policy.vocab_size) for _ in range(rng.randint(3, 12))] for _ in range(3)]
        completions = [[rng.randrange(policy.vocab_size) for _ in range(rng.randint(1, 8))] for _ in range(12)]
        batch = RolloutBatch.of(make_sequences(prompts, completions, 4, 0, share_prompt=True),
                                advantages=torch.linspace(-1, 1, 12), weights=torch.ones(12))
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as step:
            policy_backward(wrapped, batch, 4, LossConfig(), env.device, torch.autocast("cpu", enabled=False))
        gathers = [e.name for e in step.events() if e.name.startswith("FSDP::all_gather (")]
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as refresh:
            copy = engine.refresh()
        gathered = sorted({str(t) for e in refresh.events() if "all_gather" in e.name for t in (e.input_dtypes or [])
                           if t})
        full = {n: p.full_tensor() for n, p in model.named_parameters() if p.requires_grad}
        exact = all(torch.equal(t, full["backbone." + n].to(torch.bfloat16))
                    for n, t in copy.named_parameters() if "backbone." + n in full)
        rows = dc.gather_objects({"rank": env.rank, "blocks": len(policy.blocks), "micro_batches": 3,
                                  "block_gathers": sum(1 for g in gathers if "blocks." in g or ".h." in g),
                                  "gathers": gathers, "refresh_dtypes": gathered, "refresh_exact": exact})
        if env.rank == 0:  # one writer: two ranks' lines could interleave in the pipe
            for row in rows:
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
