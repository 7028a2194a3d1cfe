"""Started twice by the test with a launcher's environment (torchrun, OpenMPI, MVAPICH2 or SLURM
variables); exercises the collectives of ddp_common in a real gloo group and prints one JSON line."""
import json
import sys

import torch

from nanochat_ext import ddp_common as dc


def main(diverge: bool) -> None:
    with dc.dist_session("cpu") as env:
        total = dc.all_reduce_sum(float(env.rank + 1))
        stamp = dc.broadcast_object(1000 + env.rank)
        params = [torch.ones(3) * (1.0 + (env.rank if diverge else 0))]
        try:
            dc.check_params_in_sync(params)
            in_sync = True
        except RuntimeError:
            in_sync = False
        print(json.dumps({"rank": env.rank, "world": env.world_size, "launcher": env.launcher,
                          "backend": env.backend, "sum": total, "stamp": stamp, "in_sync": in_sync}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] == ["diverge"])
