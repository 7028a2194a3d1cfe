"""N ranks of one command, launched as torchrun launches its workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT; rank 0 hosts the rendezvous store) but without torchrun's agent: the tests that only need
ranks use it, since the agent process costs ~2 s of CPU a launch (it imports torch) and the suite launches dozens.
Tests of what the agent does (restarts, its error files and summary) launch torchrun itself.

    python tests/workers/launch.py N -m scripts.kat_train_rm -- ARGS...

The standard library only. As torchrun does, the first rank that fails ends the others, and its exit code is the
launch's (torchrun's own is 1 with a summary: the tests that read it use torchrun).
"""
import os
import socket
import subprocess
import sys
import time


def main(n: int, command: list[str]) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [subprocess.Popen([sys.executable, *command], env={
        **os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n),
        "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}) for r in range(n)]
    while True:
        codes = [p.poll() for p in ranks]
        failed = [c for c in codes if c not in (None, 0)]
        if failed or all(c == 0 for c in codes):
            break
        time.sleep(0.02)
    for p in ranks:
        if p.poll() is None:
            p.terminate()
    for p in ranks:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return failed[0] if failed else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2:]))
