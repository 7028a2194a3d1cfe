"""The model's code is hostile input (sandbox/sandbox.py, tasks/code_tests.py): a catalog of programs that try to pass
without solving the task, to escape, or to hurt the process that runs them. Each scores 0, the caller survives, the
call returns within its time limit and a second, no process it started is left, and no file appears outside its
directory. The filesystem and network cases need the namespaces: where the OS refuses them they are skipped, with
the reason, never passed."""
from __future__ import annotations

import ctypes
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pyseccomp
import pytest
from conftest import REPO

from nanochat_ext.agent import toolbox
from nanochat_ext.algorithms.rewards import call_reward_fn
from nanochat_ext.errors import InputError, Unscored
from nanochat_ext.sandbox import cgroups, sandbox, seccomp
from nanochat_ext.sandbox import child as sandbox_child
from nanochat_ext.tasks import code_functions, synthetic
from nanochat_ext.tasks.code_checks import parse_tests
from nanochat_ext.tasks.code_tests import CodeTests, passes, run_tests, verdict
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
    "the harness patched": ("import sys\nrunner = sys.modules['nanochat_ext.sandbox.code_process']\n"
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
    "a real-time signal to itself": ("import os\nos.kill(os.getpid(), 40)", "(killed by signal 40) before test 1"),
    "an exit status past 128": ("import os\nos._exit(170)", "before test 1 of 3 gave its value"),
    "a huge int inside a list": ("def add(a, b):\n    return [10 ** 5000]", "add(2, 3) gave a list too large to print"),
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
                              "the code raised OSError"),  # seccomp refuses AF_INET; without it, no route
    "a vsock socket to the host": ("import socket\nsocket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)",
                                   "the code raised OSError: [Errno 97]"),  # not behind the network namespace
    "rewriting the harness": (f"open({str(REPO / 'nanochat_ext/sandbox/child.py')!r}, 'a').write('#')",
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
    assert run_tests("def add(a, b):\n    return 10 ** 5000", TESTS)[1] == \
        "test 1 of 3: add(2, 3) gave an int of 16610 bits"
    # code that passes, then would burn the CPU to the limit (its harness's exit rebound): ended once it has answered
    hog = "import sys\nsys.modules['__main__']._exit = lambda code: [0 for _ in iter(int, 1)]\n" + SOLVED
    t0 = time.monotonic()
    assert run_tests(hog, TESTS, time_limit=LIMIT)[0] and time.monotonic() - t0 < 1.0


def test_only_the_codes_values_come_back_and_the_rest_is_judged_here():
    """Each assert: the code's values (maximal expressions from a name the tests do not define) are probes; the
    rest, literals, operators, builtins and math, is evaluated by the trainer. Forms judged in the code's reach
    (a name the tests bind, a comprehension) and asserts that ask nothing of the code are refused when read."""
    plan = parse_tests("import math\nassert f(1) == [1, 2]\nassert 3 in f(3)\nassert not f(0) is None\n"
                       "assert abs(area(2) - 12.566) < 0.001\nassert math.isclose(g(1)[0], 2.0, rel_tol=1e-3)\n"
                       "assert is_ok(5)\nassert sorted(f(2)) == sorted(h(2))")
    assert [(kind, source) for kind, source, _ in plan.steps] == [
        ("exec", "import math"), ("value", "f(1)"), ("value", "f(3)"), ("value", "f(0)"), ("value", "area(2)"),
        ("value", "g(1)[0]"), ("truth", "is_ok(5)"), ("value", "f(2)"), ("value", "h(2)")]
    assert [steps for _, steps in plan.asserts] == [[2], [3], [4], [5], [6], [7], [8, 9]]
    assert run_tests("def f(x):\n    return [x, 2] if x else None\ndef area(r):\n    return 3.1415 * r * r\n"
                     "g = f\nh = lambda x: [2, x]\nis_ok = bool", "import math\nassert f(1) == [1, 2]\n"
                     "assert 3 in f(3)\nassert not f(1) is None\nassert abs(area(2) - 12.566) < 0.001\n"
                     "assert math.isclose(g(2)[0], 2.0)\nassert is_ok(5)\nassert sorted(f(2)) == sorted(h(2))"
                     ) == (True, "all tests passed")
    for tests, why in (("x = f(2)\nassert x == 2", "`x` is defined by the tests' own statements"),
                       ("def check(v):\n    return v\nassert check(f(1))", "`check` is defined by the tests"),
                       ("assert all(f(i) for i in range(3))", "GeneratorExp"),
                       ("assert (lambda: f(1))() == 1", "Lambda"),
                       ("assert sum([1, 2]) == 3", "asks nothing of the code"),
                       ("assert f(1) == print(2)", "`print` is a builtin or standard module the trainer does not"),
                       ("assert f(1) == dict(**g(1))", "Call"),
                       ("x = 1", "no assert"), ("assert (", "line 1")):
        with pytest.raises(InputError, match=re.escape(why)):
            parse_tests(tests)
    with pytest.raises(InputError, match="line 1"):
        CodeTests({"tests": "assert ("})


FORGERIES = {  # name -> (the model's code, the row's tests): a test form MBPP uses, forged through the code's objects
    "__sub__ and __abs__ that give 0": ("class Z(float):\n    __sub__ = __rsub__ = lambda s, o: 0.0\n"
                                        "    __abs__ = lambda s: 0.0\n"
                                        "def area(r):\n    return Z(1.0)", "assert abs(area(2) - 12.566) < 0.001"),
    "an object equal to everything, minus": ("class Z:\n    __sub__ = __rsub__ = lambda s, o: 0\n"
                                             "def f(x):\n    return Z()", "assert f(2) - 7 == 0"),
    "math.isclose patched": ("import math\nmath.isclose = lambda *a, **k: True\ndef f(x):\n    return 0.0",
                             "import math\nassert math.isclose(f(1), 3.0, rel_tol=1e-3)"),
    "math shadowed where the tests do not import it": ("class math:\n    isclose = staticmethod(lambda *a, **k: True)\n"
                                                       "def volume(r):\n    return 1.0",
                                                       "assert math.isclose(volume(10), 4188.79, rel_tol=0.001)"),
    "range shadowed on the expected side": ("range = lambda n: []\ndef f(n):\n    return []",
                                            "assert f(5) == list(range(5))"),
    "Counter shadowed on the expected side": ("def Counter(x):\n    return {}\ndef f(x):\n    return [9]",
                                              "assert Counter(f([1, 1, 2])) == Counter([1, 2, 1])"),
    "builtins patched": ("import builtins\nbuiltins.abs = lambda x: 0\nbuiltins.sorted = lambda x: [1, 2]\n"
                         "def f(x):\n    return 9.0\ndef g(x):\n    return [5]",
                         "assert abs(f(1) - 3.0) < 0.1\nassert sorted(g(1)) == [1, 2]"),
}


@pytest.mark.parametrize("name", FORGERIES)
def test_a_forged_value_scores_0(name):
    """The second catalog's forgeries of test forms MBPP writes: each scores 0, the rest of the assert being
    evaluated by the trainer over plain values."""
    code, tests = FORGERIES[name]
    assert not run_tests(code, tests, time_limit=LIMIT)[0]


def test_the_verdict_never_raises_whatever_the_code_gives():
    """Every exit status and signal the code can end with, and values whose description is hard, become a failed
    test with a reason: never an exception in the trainer (a reward that raises stops the run on every rank)."""
    plan = parse_tests("assert f(1) == 2\nassert abs(f(2) - 1) < 1")
    limits = sandbox.Limits(seconds=1)
    odd = [[10 ** 5000], {"k": [1 << 70000]}, [[[[]]]], float("nan"), 1 + 2j, b"\xff" * 100, {1, 2}]
    for status in [*range(0, 256), None]:
        for values in ({}, {1: odd[status % len(odd)] if status else 2}):
            run = sandbox.Run(values=values, status=status, sealed="sealed")
            passed, said = verdict(run, plan, limits)
            assert isinstance(said, str) and said and not passed
    for value in odd:
        assert verdict(sandbox.Run(values={1: value, 2: value}, sealed="sealed"), plan, limits)[0] is False
    run = sandbox.Run(errors={1: "raised ValueError: x"}, sealed="sealed")
    assert verdict(run, plan, limits) == (False, "test 1 of 2: f(1) raised ValueError: x")
    assert verdict(sandbox.Run(values={1: 2, 2: 10 ** 300}, sealed="sealed"), plan, limits)[0] is False
    huge = parse_tests("assert 2 ** f(1) == 4\nassert 'x' * f(2) == 'xx'\nassert f(3) % 2 == '2'\n"
                       "assert len(list(range(f(4)))) == 1\nassert round(1, f(5)) == 1\nassert pow(3, f(6), f(7)) == 1")
    ok = {1: 2, 2: 2, 3: "%d", 4: 1, 5: 0}
    for values in ({1: 10 ** 9}, {1: 2, 2: 10 ** 9}, {1: 2, 2: 2, 3: "%0100000000d"}, {1: 2, 2: 2, 3: "%d", 4: 10 ** 9},
                   {**ok, 5: -10 ** 9}, {**ok, 6: 1 << 400_000, 7: (1 << 400_000) + 1}):
        said = verdict(sandbox.Run(values=values, sealed="sealed"), huge, limits)[1]
        assert "to judge" in said, (values, said)


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
             "from nanochat_ext.sandbox import sandbox\n"
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
             f"os.path.isdir({str(REPO)!r}) and 'README.md' in os.listdir({str(REPO)!r})",
             "sorted(os.listdir('/etc'))", "open('/etc/passwd').read().count(':x:')"]
    try:
        run = sandbox.run("import os\nopen('mine', 'w').write('x')", [("value", a, a) for a in asked],
                          sandbox.Limits(seconds=LIMIT))
    finally:
        host.unlink()
    # /tmp holds what it wrote (and where this checkout lies under /tmp, its Python's directories, read-only)
    tmp = run.values.pop(3)
    etc = sorted([n for n in sandbox_child.ETC if os.path.exists(f"/etc/{n}")] + list(sandbox_child.USERS))
    assert "mine" in tmp and host.name not in tmp and run.values == {1: "/tmp", 2: ["1", "2"], 4: 1, 5: "/tmp",
                                                           6: sorted(sandbox_child.DEVICES), 7: False, 8: etc,
                                                           9: 2}, run
    assert not run.errors


WALLS = """import ctypes, errno, os, socket
libc = ctypes.CDLL(None, use_errno=True)
NUMBERS = {NUMBERS}
def refused(name, *args):
    ctypes.set_errno(0)
    got = libc.syscall(NUMBERS[name], *[ctypes.c_long(a) for a in args])
    return got == -1 and ctypes.get_errno() in (errno.EPERM, errno.ENOSYS)
def family_refused(family):
    try:
        socket.socket(family, socket.SOCK_STREAM).close()
    except OSError as e:
        return e.errno == errno.EAFNOSUPPORT
    return False
def session_keyring():
    return libc.syscall(NUMBERS["keyctl"], ctypes.c_long(0), ctypes.c_long(-3), ctypes.c_long(0))
"""
REFUSED = {"keyctl": (0, -3, 0), "add_key": (0, 0, 0, 0, -3), "ptrace": (16, 1, 0, 0), "bpf": (0, 0, 0),
           "perf_event_open": (0, 0, -1, -1, 0), "userfaultfd": (0,), "io_uring_setup": (1, 0),
           "unshare": (0x10000000,), "mount": (0, 0, 0, 0, 0), "process_vm_readv": (1, 0, 0, 0, 0, 0),
           "shmget": (0, 1 << 20, 0o1600), "kill": (-1, 0)}


def unsealed_python(monkeypatch) -> None:
    """Unsealed as nobody needs a Python nobody can read: the system's where the trainer's lies under /root."""
    if os.getuid() == 0 and not sandbox_child.readable_by_others(sandbox_child.python_paths()):
        if not Path("/usr/bin/python3").is_file():
            pytest.skip("no Python that nobody can read, to run unsealed as nobody")
        monkeypatch.setattr(sandbox, "PYTHON", "/usr/bin/python3")


@pytest.mark.skipif("a seccomp filter" not in sandbox.isolation(), reason=f"no filter here: {sandbox.isolation()}")
def test_the_code_meets_a_seccomp_filter_and_a_keyring_of_its_own(monkeypatch):
    """Sealed and unsealed: the kernel's riskiest calls are refused (EPERM), System V IPC and kill(-1) too, and every
    socket family but AF_UNIX, AF_VSOCK and AF_INET included; /proc says the filter is on. Without the filter the
    code's session keyring is still its own, not the trainer's."""
    numbers = {name: pyseccomp.resolve_syscall(pyseccomp.system_arch(), name) for name in REFUSED}
    walls = WALLS.replace("{NUMBERS}", repr(numbers))
    asked = [f"refused({name!r}, *{args})" for name, args in REFUSED.items()]
    asked += ["open('/proc/self/status').read().split('Seccomp:')[1].split()[0]",
              "len(socket.socketpair(socket.AF_UNIX))", "family_refused(socket.AF_VSOCK)",
              "family_refused(socket.AF_INET)"]
    want = {**{k + 1: True for k in range(len(REFUSED))}, len(REFUSED) + 1: "2", len(REFUSED) + 2: 2,
            len(REFUSED) + 3: True, len(REFUSED) + 4: True}
    if SEALED:
        run = sandbox.launch(walls, [("value", a, a) for a in asked], sandbox.Limits(seconds=LIMIT), isolate=True)
        assert run.values == want, run
    unsealed_python(monkeypatch)
    run = sandbox.launch(walls, [("value", a, a) for a in asked], sandbox.Limits(seconds=LIMIT), isolate=False)
    assert run.values == want, ("unsealed", run)
    libc = ctypes.CDLL(None, use_errno=True)
    mine = libc.syscall(numbers["keyctl"], ctypes.c_long(0), ctypes.c_long(-3), ctypes.c_long(0))
    monkeypatch.setattr(seccomp, "program", lambda: (b"", numbers["keyctl"], "no seccomp filter (this test's)"))
    run = sandbox.launch(walls, [("value", "session_keyring()", "keyring")], sandbox.Limits(seconds=LIMIT),
                         isolate=SEALED)
    assert run.values[1] > 0 and run.values[1] != mine, (mine, run)


def test_the_sandbox_mounts_the_interpreters_directories_never_sys_path(monkeypatch, tmp_path):
    """A project root on sys.path (a .pth of `pip install -e`, a script's own directory), its .env and held-out
    tests beside its code, is not among what the sealed root shows: only the standard library, site-packages and
    the interpreter's program."""
    (tmp_path / ".env").write_text("TOKEN=secret")
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path), str(REPO)])
    shown = sandbox_child.python_paths()
    assert not [p for p in shown if str(tmp_path).startswith(p) or str(REPO).startswith(p) and p != "/"], shown
    assert os.path.dirname(os.__file__) in shown


@needs_namespaces
def test_the_kernel_memory_the_code_makes_is_bounded():
    """Empty files with user xattrs in the code's /tmp: the kernel's memory for them is bounded by the tmpfs's
    inodes (and, where a cgroup is made, by its memory.max with everything else)."""
    flood = ("import os\nmade = 0\ntry:\n    while made < 100_000:\n        p = f'/tmp/{made}'\n"
             "        open(p, 'w').close()\n        made += 1\n        os.setxattr(p, 'user.x', b'x' * 4000)\n"
             "except OSError as e:\n    stopped = e.errno\n")
    run = sandbox.run(flood, [("value", "made", "made"), ("value", "stopped", "why")], sandbox.Limits(seconds=LIMIT))
    assert run.values[1] <= sandbox_child.WORK_INODES and run.values[2] in (28, 12), run  # ENOSPC (or ENOMEM)


def test_unsealed_the_code_still_ends_with_the_call(monkeypatch):
    """Without namespaces (as where the OS refuses them): the limits, a subreaper that kills every descendant,
    nothing left, and as nobody where the caller is root. A root caller whose Python nobody cannot read (a pyenv
    under /root) does not run the code at all; the test then takes the system's Python."""
    if os.getuid() == 0 and not sandbox_child.readable_by_others(sandbox_child.python_paths()):
        refused = sandbox.launch(SOLVED, [("value", "add(2, 3)", "t")], sandbox.Limits(seconds=LIMIT), isolate=False)
        assert not refused.ran and "the code would run as root" in refused.sealed and not refused.values
    unsealed_python(monkeypatch)
    before = descendants()
    code = ("import os, time\nkids = []\nfor _ in range(3):\n    kid = os.fork()\n    if kid == 0:\n"
            "        os.setsid()\n        time.sleep(30)\n    kids.append(kid)\n")
    asked = [("value", "add(2, 3)", "t"), ("value", "os.getuid()", "uid"), ("value", "kids", "kids")]
    run = sandbox.launch(code + SOLVED, asked, sandbox.Limits(seconds=LIMIT), isolate=False)
    kids = run.values.pop(3)
    assert run.sealed == "off" and run.values == {1: 5, 2: 65534 if os.getuid() == 0 else os.getuid()}, run
    assert descendants() <= before and len(kids) == 3 and not [k for k in kids if alive(k)]  # setsid ones too


def test_a_sandbox_dies_with_its_caller(tmp_path):
    """The trainer killed (SIGKILL, no cleanup) while its sandbox runs: every process of the sandbox ends too."""
    caller = subprocess.Popen([sys.executable, "-c", f"import sys; sys.path[:0] = [{str(REPO)!r}]\n"
                               "from nanochat_ext.sandbox import sandbox\n"
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
    for d in own_cgroups(caller.pid):  # SIGKILL runs no exit, so its cgroups stay (docs/tools.md): empty, removable
        os.rmdir(d)


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


def test_a_rows_verdict_does_not_depend_on_its_neighbours():
    """8 rows whose code loops forever and 2 correct rows in one decode step, more than the sandbox's slots: the
    correct rows' wait for a slot and the sandboxes' start are not their time, so they pass within --tool_timeout
    (2 s here: the code's own limit 1 s); the looping rows fail on their own clock."""
    loop, solved = "```python\nwhile True:\n    pass\n```", f"```python\n{SOLVED}\n```"
    replies = [loop] * 8 + [solved] * 2
    games = [CodeTests({"tests": TESTS}, time_limit=1.0) for _ in replies]
    out = toolbox.call_all([(f"row {k}", lambda g=g, r=r: g.step(r)) for k, (g, r) in enumerate(zip(games, replies))],
                           timeout=2.0, text=False)
    assert [o.timed_out for o in out[8:]] == [False] * 2, [o.text for o in out]  # a looping row may overrun a
    assert [g.get_reward() for g in games] == [0.0] * 8 + [1.0] * 2, [o.text for o in out]  # loaded machine's end


def test_the_catalog_scored_in_the_rollout_thread_while_the_policy_trains(tmp_path):
    """--async_rollouts 1: the rewards of the next step's rollout are scored in the rollout thread while this step
    trains (the load beside them), by 4 reward threads at once. Each row's reward runs the row's own code, hostile or
    the solution: every sample of a solution scores 1 at every step beside looping, forking, parent-killing and
    forging neighbours, every hostile one 0, none unscored; once the run returns no process it started is left, no
    file outside its directory, and no rollout thread."""
    hostile = ["a busy loop", "many children", "a child that outlives the step", "killing its parent",
               "a forged results record", "the harness patched"]
    rows = [{"prompt": f"Write add, attempt {k}.", "code": HOSTILE[name][0], "tests": TESTS, "case": name}
            for k, name in enumerate(hostile)]
    rows += [{"prompt": f"Write add, attempt {k}.", "code": SOLVED, "tests": TESTS, "case": "solved"}
             for k in range(len(rows), len(rows) + 2)]
    prompts = synthetic.write_jsonl(tmp_path / "prompts.jsonl", rows)
    before = descendants()
    out = tmp_path / "out"
    assert kat_train_grpo.main(["--policy", str(REPO / "tests" / "fixtures" / "hf-tool-use"), "--prompts",
                                str(prompts), "--reward_fn", "rewards_for_tests:rows_code_passes",
                                "--reward_workers", "4", "--batch_size", "4", "--group_size", "2",
                                "--max_new_tokens", "4", "--max_steps", "2", "--val_ratio", "0", "--log_rollouts",
                                "--log_every", "1", "--async_rollouts", "1", "--device", "cpu",
                                "--out", str(out)]) == 0
    scored = [json.loads(line) for line in (out / "logs" / "rollouts.jsonl").read_text().splitlines()]
    assert len(scored) == 2 * 4 * 2 and {r["prompt_index"] for r in scored} == set(range(8))
    for r in scored:
        assert r["reward"] == (1.0 if rows[r["prompt_index"]]["case"] == "solved" else 0.0), \
            (rows[r["prompt_index"]]["case"], r)
    metrics = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [(m["train/sandbox_failures"], m["train/staleness"]) for m in metrics if "train/loss" in m] == \
        [(0.0, 0.0), (0.0, 1.0)]  # step 2's rollout was scored in the thread while step 1 trained
    assert not [t for t in threading.enumerate() if t.name.startswith("rollouts")]
    deadline = time.monotonic() + 5  # the child that outlives its step is ended with its sandbox
    while descendants() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not descendants() - before
    assert not leftovers()


def test_a_sandbox_that_fails_to_start_is_tried_again(monkeypatch):
    """A start that fails for the machine's reasons (the code had not run) is tried once more; twice, the run says
    so (failed_to_start) rather than a verdict on the code."""
    sandbox.seal_trial()  # this process's trial done first: it is not a run's start
    real, calls = sandbox.launch, []

    def flaky(code, steps, limits, isolate, started=None):
        calls.append(isolate)
        if calls == [isolate] or code == "never":  # the first start of all fails
            return sandbox.Run(sealed="failed: the sandbox ended (killed by SIGKILL)", unreported=True)
        if code == "reported":  # a failure the sandbox reports of itself is the same every time: not tried again
            return sandbox.Run(sealed="failed: unsealed, the code would run as root")
        return real(code, steps, limits, isolate, started)

    monkeypatch.setattr(sandbox, "launch", flaky)
    assert sandbox.run(SOLVED, [("value", "add(2, 3)", "t")], sandbox.Limits(seconds=LIMIT)).values == {1: 5}
    assert len(calls) == 2
    assert sandbox.run("never", [], sandbox.Limits(seconds=LIMIT)).failed_to_start and len(calls) == 4
    # failed twice: not a verdict on the code (0) but errors.Unscored, which GRPO leaves out of the loss
    game = CodeTests({"tests": TESTS}, time_limit=LIMIT)
    assert game.step("never") is None  # the episode ends
    with pytest.raises(Unscored):
        game.get_reward()
    with pytest.raises(Unscored):
        passes("", "never", {"tests": TESTS})
    assert math.isnan(call_reward_fn("passes", passes, "", "never", {"tests": TESTS}, 0))
    before = len(calls)
    assert run_tests("reported", TESTS)[0] is False and len(calls) == before + 1  # a verdict, 0: the start line
    # said why


@pytest.mark.skipif("cgroup v" not in sandbox.isolation(), reason=f"no cgroup here: {sandbox.isolation()}")
def test_the_sandboxs_processes_share_one_memory_bound():
    """RLIMIT_AS is per process: 3 processes under it each touch 60 MB; the sandbox's cgroup holds them to 128 MB
    together, so not all of them finish."""
    hog = ("import os, time\ndone = 0\nkids = []\nfor _ in range(3):\n    kid = os.fork()\n    if kid == 0:\n"
           "        b = bytearray(60 << 20)\n        for i in range(0, len(b), 4096):\n            b[i] = 1\n"
           "        time.sleep(0.5)\n        os._exit(0)\n    kids.append(kid)\nfor kid in kids:\n"
           "    done += os.waitstatus_to_exitcode(os.waitpid(kid, 0)[1]) == 0\n")
    run = sandbox.run(hog, [("value", "done", "done")], sandbox.Limits(seconds=LIMIT, total_memory_mb=128))
    assert run.values.get(1, 0) < 3, run


def own_cgroups(pid: int) -> list[str]:
    """The cgroup directories named after process pid beside this process's own, in every hierarchy sandboxes use."""
    where, own = cgroups.mounts(), cgroups.own_paths()
    parents = {os.path.join(where[h], own[h].lstrip("/")) for h in ("2", "memory", "pids") if h in where and h in own}
    return sorted(str(p) for parent in parents for p in Path(parent).glob(f"nanochat-sandbox-{pid}-*"))


@pytest.mark.skipif("cgroup v" not in sandbox.isolation(), reason=f"no cgroup here: {sandbox.isolation()}")
def test_a_run_that_ends_while_its_code_still_runs_leaves_no_cgroup():
    """A process that exits while a sandbox's thread still waits on looping code (a tool call past its timeout when
    the run ended): its exit kills the code and removes the cgroup, which the sandbox's own end never reached."""
    script = ("import os, sys, threading, time\nfrom nanochat_ext.sandbox import cgroups, sandbox\n"
              "loop = 'while True:\\n    pass\\n'\n"
              "threading.Thread(target=sandbox.run, args=(loop, [], sandbox.Limits(seconds=60)), daemon=True).start()\n"
              "deadline = time.monotonic() + 60\n"
              "while len(cgroups._live) < 1 and time.monotonic() < deadline:  # the looping code's cgroup is made\n"
              "    time.sleep(0.05)\n"
              "time.sleep(1)\nprint(os.getpid(), len(cgroups._live), flush=True)\nsys.exit(0)\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    pid, live = map(int, proc.stdout.split())
    assert live == 1  # the code ran in a cgroup of its own when the process exited
    assert own_cgroups(pid) == []


def test_the_exit_sweep_removes_this_processs_cgroups_only_and_then_makes_none(tmp_path, monkeypatch):
    """remove_all on a hierarchy laid out in a tmp dir: this process's cgroups that a sandbox left are removed, one a
    forked parent named is not, and no cgroup is made after the sweep began."""
    monkeypatch.setattr(cgroups, "_live", set())
    monkeypatch.setattr(cgroups, "_closing", False)
    mine = [tmp_path / h / f"nanochat-sandbox-{os.getpid()}-7" for h in ("memory", "pids")]
    parents = [tmp_path / "memory" / "nanochat-sandbox-1-3"]  # another pid's: a parent this process was forked from
    for d in mine + parents:
        d.mkdir(parents=True)
    cgroups._live.update({tuple(map(str, mine)), (str(parents[0]),)})
    cgroups.remove_all()
    assert not any(d.exists() for d in mine) and parents[0].is_dir()
    assert cgroups.make(64 << 20, 8) == (None, "no cgroup: the process is exiting")
