"""The model's code is hostile input (runtime/sandbox.py, tasks/code_tests.py): a catalog of programs that try to pass
without solving the task, to escape, or to hurt the process that runs them. Each scores 0, the caller survives, the
call returns within its time limit and a second, no process it started is left, and no file appears outside its
directory. The filesystem and network cases need the namespaces: where the OS refuses them they are skipped, with
the reason, never passed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import REPO
from nanochat_ext.errors import InputError
from nanochat_ext.runtime import sandbox, sandbox_child
from nanochat_ext.tasks import code_functions, synthetic
from nanochat_ext.tasks.code_tests import CodeTests, parse_tests, passes, run_tests
from scripts import kat_train_grpo

TESTS = "assert add(2, 3) == 5\nassert add(-4, 1) == -3\nassert not add(0, 0)"
SOLVED = "def add(a, b):\n    return a + b"
LIMIT = 2.0
SEALED = sandbox.isolation().startswith("sealed")
needs_namespaces = pytest.mark.skipif(not SEALED, reason=f"this machine gives no namespaces: {sandbox.isolation()}")
MARK = f"sandbox-escape-{uuid.uuid4().hex[:8]}"  # a name the hostile programs write, looked for afterwards

HOSTILE = {  # name -> (the model's code, what the model reads of the failure, in part)
    "sys.exit(0)": ("import sys\nsys.exit(0)", "the code exited (SystemExit: 0)"),
    "raise SystemExit": ("raise SystemExit(0)", "the code exited (SystemExit: 0)"),
    "os._exit(0)": ("import os\nos._exit(0)", "ended (exit code 0) before test 1"),
    "exit inside the function": ("def add(a, b):\n    raise SystemExit(0)", "add(2, 3) exited (SystemExit: 0)"),
    "an atexit hook": ("import atexit, os\natexit.register(os._exit, 0)\nraise ValueError('x')",
                       "the code raised ValueError: x"),
    "an excepthook": ("import os, sys\nsys.excepthook = lambda *a: os._exit(0)\n1 / 0", "raised ZeroDivisionError"),
    "a signal to itself": ("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)", "killed by SIGTERM"),
    "exec of another program": ("import os, sys\nos.execv(sys.executable, [sys.executable, '-c', 'print(5)'])",
                                "ended (exit code 0)"),
    "an __eq__ that is always true": ("class Yes:\n    def __eq__(self, other):\n        return True\n"
                                      "    __bool__ = lambda self: False\n"
                                      "def add(a, b):\n    return Yes()", "returned Yes, not a plain value"),
    "an int subclass": ("class Int(int):\n    def __eq__(self, other):\n        return True\n"
                        "def add(a, b):\n    return Int(0)", "add(2, 3) gave 0"),  # compared as the int it is
    "the harness patched": ("import sys\nrunner = sys.modules['__main__']\n"
                            "runner.encode = lambda value, depth=0: ['int', '0x5']\n"
                            "def add(a, b):\n    return 0", "test 2 of 3: add(-4, 1) gave 5"),
    "the tests looked for": ("import gc, re, sys\n"
                             "def add(a, b):\n"
                             "    found = [o for o in gc.get_objects() if isinstance(o, str) and '== ' in o]\n"
                             "    frames = [sys._getframe(k).f_locals for k in range(1, 3)]\n"
                             "    text = ' '.join(found + [repr(f) for f in frames])\n"
                             "    m = re.search(r'add\\(2, 3\\) == (\\d+)', text)\n"
                             "    return int(m.group(1)) if m else 0", "add(2, 3) gave 0"),
    "a forged results record": ("import os\nfor fd in range(3, 40):\n    try:\n"
                                "        os.write(fd, b'{\"step\": 1, \"value\": [\"bool\", true]}\\n')\n"
                                "    except OSError:\n        pass\nos._exit(0)", "add(2, 3) gave True"),
    "reading stdin": ("data = input()\n" + SOLVED, "the code raised EOFError"),
    "an output flood": ("import sys\nfor _ in range(10):\n    sys.stdout.write('x' * (5 << 20))\n"
                        "    sys.stderr.write('y' * (5 << 20))\n" + SOLVED + "\nadd = lambda a, b: 0",
                        "add(2, 3) gave 0"),  # 100 MB here; 600 MB and the caller's memory: a test below
    "killing its own group": ("import os, signal\nos.killpg(os.getpgid(0), signal.SIGKILL)", "killed by SIGKILL"),
    "killing its parent": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\ndef add(a, b):\n    return 0",
                           "add(2, 3) gave 0"),
    "a busy loop": ("while True:\n    pass", "before test 1 of 3"),
    "memory past the limit": ("hog = bytearray(2 << 30)", "the code raised MemoryError"),
    "many children": ("import os, time\nkids = 0\ntry:\n    for _ in range(64):\n        if os.fork() == 0:\n"
                      "            time.sleep(60)\n            os._exit(0)\n        kids += 1\nexcept OSError:\n"
                      "    pass\ndef add(a, b):\n    return kids", "add(2, 3) gave 7"),  # 8 processes at most
    "a child that outlives the step": (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(1.5)\n"
        f"    open('{MARK}-late', 'w').write('x')\n    os._exit(0)\ndef add(a, b):\n    return 0", "add(2, 3) gave 0"),
}
SEALED_ONLY = {  # need the namespaces: the filesystem and the network
    "writing in its own /tmp": (f"open('/tmp/{MARK}', 'w').write('x')\ndef add(a, b):\n    return 0",
                                "add(2, 3) gave 0"),  # its private /tmp: nothing on the host's (leftovers)
    "writing outside its directory": (f"open('/var/tmp/{MARK}', 'w').write('x')", "the code raised"),
    "writing into the project": (f"try:\n    open({str(REPO / MARK)!r}, 'w').write('x')\nexcept OSError:\n    pass\n"
                                 "def add(a, b):\n    return 0", "add(2, 3) gave 0"),  # a checkout under /tmp: its
    # path is in the code's own /tmp, where the write lands; either way nothing reaches the project (leftovers)
    "reading the project": (f"open({str(REPO / 'README.md')!r}).read()", "the code raised FileNotFoundError"),
    "reading root's home": ("open('/root/.bashrc').read()", "the code raised FileNotFoundError"),
    "a terminal device": ("open('/dev/ptmx', 'rb')", "the code raised FileNotFoundError"),
    "SysV shared memory": ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                           "def add(a, b):\n    return libc.shmget(0, 200 << 20, 0o1600)", "add(2, 3) gave -1"),
    "a socket to 127.0.0.1": ("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)",
                              "Network is unreachable"),
    "rewriting the harness": (f"open({str(REPO / 'nanochat_ext/runtime/sandbox_child.py')!r}, 'a').write('#')",
                              "the code raised"),
}


def descendants(pid: int | None = None) -> set[int]:
    """The living descendants of pid (this process), from the children lists of /proc."""
    found, todo = set(), [pid or os.getpid()]
    while todo:
        try:
            tasks = list(Path(f"/proc/{todo.pop()}/task").iterdir())
        except OSError:  # it ended since its parent listed it
            continue
        for task in tasks:
            try:
                kids = {int(k) for k in (task / "children").read_text().split()}
            except OSError:
                continue
            found |= kids
            todo += kids
    return found


def leftovers() -> list[str]:
    return [str(p) for d in (Path("/tmp"), REPO, Path.cwd()) for p in d.glob(f"{MARK}*")]


@pytest.mark.parametrize("name", [*HOSTILE, *SEALED_ONLY])
def test_hostile_code_scores_0_and_leaves_nothing(name):
    if name in SEALED_ONLY and not SEALED:
        pytest.skip(f"needs the namespaces, which this machine refuses: {sandbox.isolation()}")
    code, said = {**HOSTILE, **SEALED_ONLY}[name]
    before = descendants()
    t0 = time.monotonic()
    game = CodeTests({"tests": TESTS}, time_limit=LIMIT)
    answer = game.step(f"```python\n{code}\n```")
    took = time.monotonic() - t0
    assert game.get_reward() == 0.0 and (said in answer or not SEALED), answer
    assert took < LIMIT + 1.0, took
    assert descendants() <= before  # no process of the run is left
    time.sleep(0.1 if name != "a child that outlives the step" else 1.6)
    assert not leftovers()


def test_the_solution_passes_and_each_failure_says_what_the_code_gave():
    assert run_tests(SOLVED, TESTS) == (True, "all tests passed")
    assert run_tests("def add(a, b):\n    return a - b", TESTS) == (False, "test 1 of 3: add(2, 3) gave -1")
    assert run_tests("def add(a, b):\n    return 5", TESTS) == (False, "test 2 of 3: add(-4, 1) gave 5")
    assert run_tests("def add(a, b):\n    return a + b + 1", "assert not add(0, 0) == 1") == (
        False, "test 1 of 1: add(0, 0) gave 1")
    assert run_tests("def add(a, b):\n    return 'x'", "assert add(1, 2) > 0")[1] == \
        "test 1 of 1: add(1, 2) gave 'x', which cannot be compared (TypeError)"
    assert run_tests("def add(a, b):\n    retrun a", TESTS)[1].startswith("the code raised SyntaxError")
    assert run_tests("import time\ntime.sleep(5)", TESTS, time_limit=1) == (
        False, "the code's process ended (timed out after 1 s) before test 1 of 3 gave its value")
    assert run_tests("def add(a, b):\n    return 10 ** 5000", TESTS)[1] == "test 1 of 3: add(2, 3) gave an int of 16610 bits"
    # code that passes, then would burn the CPU to the limit (its harness's exit rebound): ended once it has answered
    hog = "import sys\nsys.modules['__main__']._exit = lambda code: [0 for _ in iter(int, 1)]\n" + SOLVED
    t0 = time.monotonic()
    assert run_tests(hog, TESTS, time_limit=LIMIT)[0] and time.monotonic() - t0 < 1.0


def test_tests_are_judged_here_where_they_compare_with_a_literal():
    """`<expression> <op> <literal>` (either way round, `not` in front) sends only the expression; anything else is
    judged by its truth value, and other statements run in order."""
    steps, checks = parse_tests("import math\nassert f(1) == [1, 2]\nassert 3 in f(3)\nassert not f(0) is None\n"
                                "x = f(2)\nassert math.isclose(x[0], 2.0)")
    assert [(kind, source) for kind, source, _ in steps] == [
        ("exec", "import math"), ("value", "f(1)"), ("value", "f(3)"), ("value", "f(0)"), ("exec", "x = f(2)"),
        ("truth", "math.isclose(x[0], 2.0)")]
    assert [(c.literal, c.literal_first, c.negated) for c in checks.values()] == [
        ([1, 2], False, False), (3, True, False), (None, False, True), (None, False, False)]
    assert run_tests("def f(x):\n    return [x, 2] if x else None",
                     "import math\nassert f(1) == [1, 2]\nassert 3 in f(3)\nassert not f(1) is None\nx = f(2)\n"
                     "assert math.isclose(x[0], 2.0)") == (True, "all tests passed")
    with pytest.raises(InputError, match="no assert"):
        parse_tests("x = 1")
    with pytest.raises(InputError, match="line 1"):
        CodeTests({"tests": "assert ("})


def test_the_values_that_come_back_are_plain_data():
    """Every plain type comes back as itself (set, frozenset, bytes, complex, floats exactly, nested); anything the
    results pipe carries that is not a record marks the run garbled."""
    values = [{1: (2.5, b"x")}, {3, 4}, frozenset({"a"}), 1 + 2j, float("inf"), -(1 << 100), 0.1, True, None, "é"]
    asked = [repr(v) if v != float("inf") else "float('inf')" for v in values]
    run = sandbox.run("", [("value", a, "v") for a in asked], sandbox.Limits(seconds=LIMIT))
    assert [run.values[k + 1] for k in range(len(values))] == values and not run.garbled
    assert all(type(run.values[k + 1]) is type(v) for k, v in enumerate(values))
    out = sandbox.Run()
    sandbox.read_records(b'{"step": 1, "value": ["int", "0x5"]}\n{"step": 1, "value": ["int", "0x6"]}\n', out)
    assert out.values == {1: 5} and "written to" in out.garbled
    collisions = json.dumps({"step": 4, "value": ["set", [["int", hex(k * (2 ** 61 - 1))] for k in range(30_000)]]})
    for junk in (b"[1]", b'{"step": 2, "value": ["object", 1]}', b'{"step": 3, "value": ["dict", [[["list", []], '
                                                                  b'["int", "0x1"]]]]}', b"[" * 100_000,
                 collisions.encode()):  # 30k ints of one hash: too long a record, and too many values
        out = sandbox.Run()
        sandbox.read_records(junk, out)
        assert out.garbled and not out.values


def test_the_callers_memory_stays_bounded_whatever_the_code_writes():
    """600 MB on stdout and stderr: the caller keeps 8 KB of each (its peak RSS grows by far less than the flood)."""
    flood = ("import sys\nfor _ in range(30):\n    sys.stdout.write('x' * (10 << 20))\n"
             "    sys.stderr.write('y' * (10 << 20))\n")
    probe = (f"import resource, sys; sys.path[:0] = [{str(REPO)!r}]\n"
             "from nanochat_ext.runtime import sandbox\n"
             "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
             f"run = sandbox.run({flood!r}, [], sandbox.Limits(seconds=20, memory_mb=1024))\n"
             "grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before\n"
             "print(len(run.stdout), len(run.stderr), grown >> 10)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    kept_out, kept_err, grown_mb = map(int, out.stdout.split())
    assert (kept_out, kept_err) == (sandbox.KEPT_OUTPUT, sandbox.KEPT_OUTPUT) and grown_mb < 50, out


@needs_namespaces
def test_the_sealed_code_sees_its_own_directory_and_no_process_outside():
    """Its cwd, $HOME and /tmp are its own; of the project only the Python installation shows; /dev holds five
    devices; pid 1 is its init and no process outside shows."""
    host = Path("/tmp") / f"{MARK}-host"
    host.write_text("the host's /tmp")
    asked = ["os.getcwd()", "sorted(p for p in os.listdir('/proc') if p.isdigit())", "os.listdir('/tmp')",
             "os.getppid()", "os.path.expanduser('~')", "sorted(os.listdir('/dev'))",
             f"os.path.isdir({str(REPO)!r}) and 'README.md' in os.listdir({str(REPO)!r})"]
    try:
        run = sandbox.run("import os\nopen('mine', 'w').write('x')", [("value", a, a) for a in asked],
                          sandbox.Limits(seconds=LIMIT))
    finally:
        host.unlink()
    # /tmp holds what it wrote (and where this checkout lies under /tmp, its Python's directories, read-only)
    tmp = run.values.pop(3)
    assert "mine" in tmp and host.name not in tmp and run.values == {1: "/tmp", 2: ["1", "2"], 4: 1, 5: "/tmp",
                                                           6: sorted(sandbox_child.DEVICES), 7: False}, run
    assert not run.errors


def test_unsealed_the_code_still_ends_with_the_call(monkeypatch):
    """Without namespaces (as where the OS refuses them): the limits, a subreaper that kills every descendant,
    nothing left, and as nobody where the caller is root. A root caller whose Python nobody cannot read (a pyenv
    under /root) does not run the code at all; the test then takes the system's Python."""
    if os.getuid() == 0 and not sandbox_child.readable_by_others(sandbox_child.python_paths()):
        refused = sandbox.launch(SOLVED, [("value", "add(2, 3)", "t")], sandbox.Limits(seconds=LIMIT), isolate=False)
        assert not refused.ran and "the code would run as root" in refused.sealed and not refused.values
        if not Path("/usr/bin/python3").is_file():
            pytest.skip("no Python that nobody can read, to run unsealed as nobody")
        monkeypatch.setattr(sandbox, "PYTHON", "/usr/bin/python3")
    before = descendants()
    code = "import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n        os.setsid()\n        time.sleep(30)\n"
    asked = [("value", "add(2, 3)", "t"), ("value", "os.getuid()", "uid")]
    run = sandbox.launch(code + SOLVED, asked, sandbox.Limits(seconds=LIMIT), isolate=False)
    assert run.sealed == "off" and run.values == {1: 5, 2: 65534 if os.getuid() == 0 else os.getuid()}, run
    assert descendants() <= before


def test_a_sandbox_dies_with_its_caller(tmp_path):
    """The trainer killed (SIGKILL, no cleanup) while its sandbox runs: every process of the sandbox ends too."""
    caller = subprocess.Popen([sys.executable, "-c", f"import sys; sys.path[:0] = [{str(REPO)!r}]\n"
                               "from nanochat_ext.runtime import sandbox\n"
                               "sandbox.run('import time\\ntime.sleep(30)', [], sandbox.Limits(seconds=30))"])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len(descendants(caller.pid)) < 2:  # the trial's sandbox, then the run's
        time.sleep(0.05)
    time.sleep(1.0)
    sandboxed = descendants(caller.pid)
    assert sandboxed, "no sandbox started"
    caller.kill()
    caller.wait()
    time.sleep(0.5)
    assert not [p for p in sandboxed if alive(p)], {p: Path(f"/proc/{p}/status").read_text()[:80] for p in sandboxed
                                                    if alive(p)}


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie waiting for init to reap it does not)."""
    try:
        state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State"))
    except (OSError, StopIteration):
        return False
    return "zombie" not in state


def test_the_code_task_is_solved_by_its_functions_and_not_by_near_misses():
    """kat_task_data --task code_functions: each kind's function passes its row's tests and the pair's rejected one
    (the next constant) fails them; held-out (kind, constant) never occur in training; `passes` scores a reply."""
    train, held_out = code_functions.make_questions(60, 12, seed=0)
    assert {r["kind"] for r in held_out} == set(code_functions.KINDS)
    assert not {r["prefix_id"] for r in held_out} & {r["prefix_id"] for r in train}
    rows = [next(r for r in train if r["kind"] == kind) for kind in code_functions.KINDS]
    for r, pair in zip(rows, code_functions.make_pairs(rows, seed=1)):
        chosen, rejected = (pair[side][0]["content"] for side in ("chosen", "rejected"))
        assert passes(r["prompt"], f"Here:\n{chosen}", r) == 1.0, (r, chosen)
        assert passes(r["prompt"], rejected, r) == 0.0, (r, rejected)


def test_grpo_runs_the_code_task_sealed(tmp_path, capsys):
    """--preset code_functions on a tiny chat model (tests/fixtures/hf-tool-use, which ends its turns): CodeTests
    answers each turn and the episode goes on to a second, its reward is logged, and the start line says what
    isolation the model's code gets."""
    prompts = synthetic.write_jsonl(tmp_path / "prompts.jsonl", code_functions.make_questions(8, 0, seed=0)[0])
    model = REPO / "tests" / "fixtures" / "hf-tool-use"
    assert kat_train_grpo.main(["--policy", str(model), "--prompts", str(prompts), "--preset", "code_functions",
                                "--batch_size", "2", "--group_size", "2", "--max_new_tokens", "48", "--max_steps", "1",
                                "--val_ratio", "0", "--tool_timeout", "4", "--device", "cpu",
                                "--out", str(tmp_path / "out")]) == 0
    said = capsys.readouterr().out
    assert f"environment: nanochat_ext.tasks.code_tests:CodeTests (it gives a reward); the model's code runs " \
           f"{sandbox.isolation()}" in said
    metrics = json.loads((tmp_path / "out" / "logs" / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["train/reward_env"] == 0.0 and metrics["train/env_timeouts"] == 0.0 and metrics["train/turns"] > 1
