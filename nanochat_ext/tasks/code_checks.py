"""How a code task's tests are judged outside the code's reach (tasks/code_tests.py runs them).

An assert is split in two. The values of the code's own names (a call `f(2)`, a name `PI`, `f(x)[0]`, `obj.m(1)`:
whatever starts at a name that is not the tests', not a builtin's and not a standard module's) are asked of the
sandbox, one probe each, and come back as plain data of exact types (int, float, str, bytes, bool, None, complex, and
lists, tuples, dicts and sets of them). The rest of the assert is evaluated here, in the trainer, by a small
evaluator over the AST that knows literals, operators, comparisons, `and`/`or`/`not`, `x if c else y`, subscripts,
the pure builtins in BUILTINS (range, pow and round bounded), the math module (imported by the tests or not),
collections' Counter and OrderedDict, and a few methods of plain values (str.lower, dict.keys, ...). Nothing of the
code's (an `__eq__`, `__sub__`, a patched or shadowed `math`, `range` or `Counter`) takes part, so
`abs(area(2) - 12.566) < 0.001`, `f(x) - L == 0`, `math.isclose(f(x), L)` and `f(5) == list(range(5))` cannot be
forged. Whatever would make something huge of the code's values (a power, a shift, a repeat, a %-format's width, a
range, round's digits) fails the test instead.

An assert that is one probe alone (`assert is_valid(x)`, `assert not f(0)`) is judged by the truth the code's
process computes: the code chooses that value either way. Refused when a row is read (InputError naming the test):
an assert whose judged part uses a name the tests' own statements define (`x = ...`, `def helper`: the code could
change it while the tests run), a builtin or module the evaluator does not know (`print`, `re`), a form it does not
know (a lambda, a comprehension, an f-string, `*args`, `**kwargs`), or an assert that asks nothing of the code.
"""
from __future__ import annotations

import ast
import builtins
import collections
import math
import operator
import re
import sys
from dataclasses import dataclass
from typing import Any

from nanochat_ext.errors import InputError

BUILTINS = {f.__name__: f for f in (abs, round, len, sorted, set, frozenset, list, tuple, dict, sum, min, max, all,
                                    any, int, float, str, bool, complex, isinstance, type, repr, divmod, zip,
                                    reversed, enumerate, chr, ord, bin, hex, oct, map, filter)}
BUILTINS.update(range=lambda *a: bounded_range(*a), pow=lambda *a: bounded_pow(*a),
                round=lambda *a, **k: bounded_round(*a, **k))
MATH = {name: getattr(math, name) for name in (
    "isclose", "sqrt", "isqrt", "floor", "ceil", "trunc", "fabs", "exp", "log", "log2", "log10", "pow", "sin", "cos",
    "tan", "asin", "acos", "atan", "atan2", "hypot", "degrees", "radians", "isnan", "isinf", "isfinite", "copysign",
    "fsum", "gcd", "lcm", "pi", "e", "tau", "inf", "nan")}
COLLECTIONS = {"Counter": collections.Counter, "OrderedDict": collections.OrderedDict}
SAFE_MODULES = {"math": MATH, "collections": COLLECTIONS}
NEVER_THE_CODES = set(dir(builtins)) | set(sys.stdlib_module_names) | set(COLLECTIONS)  # the code may shadow them:
# never its to judge
METHODS = {str: {"lower", "upper", "strip", "lstrip", "rstrip", "split", "rsplit", "startswith", "endswith", "count",
                 "find", "rfind", "index", "isdigit", "isalpha", "isalnum", "isspace", "isupper", "islower", "title",
                 "capitalize", "join", "splitlines"},
           list: {"count", "index"}, tuple: {"count", "index"}, dict: {"keys", "values", "items", "get"},
           set: {"issubset", "issuperset", "isdisjoint"}, frozenset: {"issubset", "issuperset", "isdisjoint"},
           bytes: {"decode", "startswith", "endswith", "count"}, collections.Counter: {"most_common", "keys", "values",
                                                                                        "items", "get"}}
BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.LShift: operator.lshift,
          ast.RShift: operator.rshift, ast.BitAnd: operator.and_, ast.BitOr: operator.or_, ast.BitXor: operator.xor}
UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_, ast.Invert: operator.invert}
COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
           ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not,
           ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}
MAX_BITS = 1 << 16  # an int the evaluator makes (a power, a shift) at most; a sequence it repeats: MAX_ITEMS
MAX_ITEMS = 1 << 20


class Unjudged(ValueError):
    """A value the evaluator will not compute (too large), or a probe that gave no value."""


@dataclass(frozen=True)
class Judged:
    """One assert: the probes asked of the sandbox (their sources), and the expression evaluated here with probe k
    read as the name `_probe_k`; `alone`: the assert is one probe (under `not`s, `negated`), judged by its truth."""
    source: str
    probes: tuple[str, ...]
    expr: ast.Expression
    names: dict[str, Any]  # the builtins, modules and functions the expression may name
    alone: bool = False
    negated: bool = False

    def holds(self, values: list[Any]) -> bool:
        """Whether the assert holds, the probes' values given (a probe that failed: an Unjudged in its place,
        raised when the evaluation reads it). Raises what the evaluation raises (TypeError, Unjudged, ...)."""
        if self.alone:
            return read(values[0]) != self.negated
        return bool(Evaluator(values, self.names).eval(self.expr.body))


def read(value: Any) -> Any:
    if isinstance(value, Unjudged):
        raise value
    return value


class Splitter:
    """An assert's test split into probes (maximal subexpressions rooted at a name of the code's) and the rest,
    checked to be a form the evaluator knows; `defined`: the names the tests' own statements bind."""

    def __init__(self, defined: set[str], safe: dict[str, Any]):
        self.defined, self.safe, self.probes = defined, safe, []  # safe: the names evaluated here

    def code_rooted(self, node: ast.expr) -> bool:
        """Whether node starts at a name of the code's: not the tests', not one the trainer evaluates, and not a
        builtin's or a standard module's (the code may shadow `range` or `math`: they are never its to judge)."""
        while isinstance(node, (ast.Call, ast.Attribute, ast.Subscript)):
            node = node.func if isinstance(node, ast.Call) else node.value
        return isinstance(node, ast.Name) and node.id not in self.defined | self.safe.keys() | NEVER_THE_CODES

    def split(self, node: ast.expr) -> ast.expr:
        if self.code_rooted(node):
            self.probes.append(ast.unparse(node))
            return ast.Name(f"_probe_{len(self.probes) - 1}", ast.Load())
        if isinstance(node, ast.Name):
            if node.id in self.defined and node.id not in self.safe:
                raise InputError(f"`{node.id}` is defined by the tests' own statements, which run beside the code: "
                                 f"it could change it; compare the code's values with literals")
            if node.id not in self.safe:
                raise InputError(f"`{node.id}` is a builtin or standard module the trainer does not evaluate (it "
                                 f"knows {', '.join(sorted(k for k in self.safe if not k.startswith('_')))[:200]}...)")
            return node
        allowed = (ast.Constant, ast.Tuple, ast.List, ast.Set, ast.Dict, ast.BinOp, ast.UnaryOp, ast.BoolOp,
                   ast.Compare, ast.IfExp, ast.Call, ast.Attribute, ast.Subscript, ast.Slice, ast.keyword)
        if not isinstance(node, allowed) or isinstance(node, ast.Call) and (
                any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords)) \
                or isinstance(node, ast.Dict) and None in node.keys:
            raise InputError(f"{type(node).__name__} ({ast.unparse(node)[:40]}) is not a form judged outside the "
                             f"code's reach")
        for name, value in ast.iter_fields(node):
            if isinstance(value, ast.AST) and not isinstance(value, (ast.operator, ast.cmpop, ast.unaryop,
                                                                     ast.boolop, ast.expr_context)):
                setattr(node, name, self.split(value))
            elif isinstance(value, list):
                setattr(node, name, [self.split(v) if isinstance(v, (ast.expr, ast.keyword)) else v for v in value])
        return node


def judged(test: ast.expr, defined: set[str], safe: dict[str, Any]) -> Judged:
    """An assert's test as probes and the trainer's expression (safe: the names evaluated here); InputError for a
    form judged in the code's reach, or a test that asks nothing of the code."""
    source = ast.unparse(test)
    inner, negated = test, False
    while isinstance(inner, ast.UnaryOp) and isinstance(inner.op, ast.Not):
        inner, negated = inner.operand, not negated
    splitter = Splitter(defined, safe)
    if splitter.code_rooted(inner):
        return Judged(source, (ast.unparse(inner),), ast.Expression(ast.Constant(None)), dict(safe), True, negated)
    expr = ast.Expression(splitter.split(ast.parse(source, mode="eval").body))
    if not splitter.probes:
        raise InputError("it asks nothing of the code (every name in it is evaluated by the trainer: a function the "
                         "code is to write needs a name no builtin has)")
    return Judged(source, tuple(splitter.probes), expr, dict(safe))


def bound(tree: ast.stmt, safe: dict[str, Any]) -> set[str]:
    """The names a statement of the tests binds; an import of a module the evaluator knows (math) adds its names to
    `safe` (the statement still runs in the sandbox, for the probes)."""
    names: set[str] = set()
    if isinstance(tree, ast.Import):
        for a in tree.names:
            if a.name in SAFE_MODULES and a.asname is None:
                safe[a.name] = SAFE_MODULES[a.name]
            else:
                names.add((a.asname or a.name).split(".")[0])
        return names
    if isinstance(tree, ast.ImportFrom) and tree.module in SAFE_MODULES and not tree.level:
        for a in tree.names:
            if a.name == "*":
                safe.update(SAFE_MODULES[tree.module])
            elif a.name in SAFE_MODULES[tree.module]:
                safe[a.asname or a.name] = SAFE_MODULES[tree.module][a.name]
            else:
                names.add(a.asname or a.name)
        return names
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    for name in names:  # rebound by the tests: theirs now, not the trainer's
        safe.pop(name, None)
    return names


class Evaluator:
    """The judged part of an assert, evaluated here over plain values: ValueError-kind errors for what is refused
    (a power or a repeat too large), TypeError and the like for what Python would raise."""

    def __init__(self, values: list[Any], names: dict[str, Any]):
        self.values, self.names = values, names

    def eval(self, node: ast.expr) -> Any:
        method = getattr(self, type(node).__name__, None)
        if method is None:
            raise Unjudged(f"{type(node).__name__} is not evaluated here")
        return method(node)

    def Constant(self, node):
        return node.value

    def Name(self, node):
        if node.id.startswith("_probe_"):
            return read(self.values[int(node.id.removeprefix("_probe_"))])
        if node.id in self.names:
            return self.names[node.id]
        raise Unjudged(f"name {node.id!r} is not known here")

    def Tuple(self, node):
        return tuple(self.eval(e) for e in node.elts)

    def List(self, node):
        return [self.eval(e) for e in node.elts]

    def Set(self, node):
        return {self.eval(e) for e in node.elts}

    def Dict(self, node):
        if any(k is None for k in node.keys):
            raise Unjudged("a ** in a dict display is not evaluated here")
        return {self.eval(k): self.eval(v) for k, v in zip(node.keys, node.values)}

    def BinOp(self, node):
        a, b = self.eval(node.left), self.eval(node.right)
        size_check(type(node.op), a, b)
        return BINARY[type(node.op)](a, b)

    def UnaryOp(self, node):
        return UNARY[type(node.op)](self.eval(node.operand))

    def BoolOp(self, node):
        value = None
        for v in node.values:
            value = self.eval(v)
            if bool(value) == isinstance(node.op, ast.Or):
                return value
        return value

    def Compare(self, node):
        left = self.eval(node.left)
        for op, right_node in zip(node.ops, node.comparators):
            right = self.eval(right_node)
            if not COMPARE[type(op)](left, right):
                return False
            left = right
        return True

    def IfExp(self, node):
        return self.eval(node.body) if self.eval(node.test) else self.eval(node.orelse)

    def Subscript(self, node):
        return self.eval(node.value)[self.eval(node.slice)]

    def Slice(self, node):
        return slice(*(None if n is None else self.eval(n) for n in (node.lower, node.upper, node.step)))

    def Attribute(self, node):
        if isinstance(node.value, ast.Name) and any(self.names.get(node.value.id) is m for m in SAFE_MODULES.values()):
            module = self.names[node.value.id]
            if node.attr not in module:
                raise Unjudged(f"{node.value.id}.{node.attr} is not evaluated here")
            return module[node.attr]
        owner = self.eval(node.value)
        if node.attr not in METHODS.get(type(owner), ()):
            raise Unjudged(f"{type(owner).__name__}.{node.attr} is not evaluated here")
        return getattr(owner, node.attr)

    def Call(self, node):
        fn = self.eval(node.func)
        owner = getattr(fn, "__self__", None)
        known = [f for v in self.names.values() for f in (v.values() if isinstance(v, dict) else [v])]
        if not any(fn is f for f in known) and not (
                type(owner) in METHODS and getattr(fn, "__name__", None) in METHODS[type(owner)]):
            raise Unjudged(f"{getattr(fn, '__name__', type(fn).__name__)} is not called here")
        args = [self.eval(a) for a in node.args]
        if any(k.arg is None for k in node.keywords):
            raise Unjudged("a ** in a call is not evaluated here")
        return fn(*args, **{k.arg: self.eval(k.value) for k in node.keywords})


FORMAT_FIELD = re.compile(rb"%[-#0 +]*(\*|\d*)(?:\.(\*|\d*))?")


def bounded_range(*args: int) -> range:
    r = range(*args)
    if len(r) > MAX_ITEMS:
        raise Unjudged(f"a range of {len(r)} items is too large to judge")
    return r


def bounded_pow(base: Any, exp: Any, mod: Any = None) -> Any:
    if mod is None:
        size_check(ast.Pow, base, exp)
    elif isinstance(exp, int) and isinstance(mod, int) and exp.bit_length() * mod.bit_length() > MAX_BITS * 64:
        raise Unjudged("a modular power too large to judge")
    return pow(base, exp, mod)


def bounded_round(number: Any, ndigits: Any = None) -> Any:
    if isinstance(ndigits, int) and abs(ndigits) > 4300:  # an int's round to -10**9 digits makes 10**(10**9)
        raise Unjudged("a round to too many digits to judge")
    return round(number) if ndigits is None else round(number, ndigits)


def size_check(op: type, a: Any, b: Any) -> None:
    """Refuse an operation on the code's values that would make something huge (a power, a shift, a repeat, a
    %-format's width)."""
    if op is ast.Mod and isinstance(a, (str, bytes)):
        text = a.encode(errors="replace") if isinstance(a, str) else a
        if any(w == b"*" or p == b"*" or len(w) > 4 or len(p or b"") > 4 for w, p in FORMAT_FIELD.findall(text)):
            raise Unjudged("a %-format too wide to judge")
    ints = isinstance(a, int) and isinstance(b, int)
    if op is ast.Pow and ints and abs(a) > 1 and b > 0 and a.bit_length() * b > MAX_BITS:
        raise Unjudged(f"a power of {a.bit_length()} bits to {b} is too large to judge")
    if op is ast.LShift and ints and b > MAX_BITS:
        raise Unjudged("a shift too large to judge")
    if op is ast.Mult:
        for seq, n in ((a, b), (b, a)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_ITEMS:
                raise Unjudged("a repeat too large to judge")


@dataclass(frozen=True)
class Plan:
    """A row's tests as the sandbox runs them and as they are judged here: the steps after the code (kind, source,
    name: the tests' statements, "exec", in order, and each assert's probes), and each assert with its probes'
    step numbers (the code is step 0)."""
    steps: list[tuple[str, str, str]]
    asserts: list[tuple[Judged, list[int]]]


def parse_tests(tests: str) -> Plan:
    """The plan of a row's tests; InputError where they do not parse, hold no assert, or hold one that would be
    judged in the code's reach."""
    try:
        tree = ast.parse(tests)
    except SyntaxError as e:
        raise InputError(f"tests: line {e.lineno}: {e.msg}") from None
    steps, asserts, defined, safe = [], [], set(), {**BUILTINS, **SAFE_MODULES, **COLLECTIONS}  # imported or not
    for node in tree.body:
        if not isinstance(node, ast.Assert):
            defined |= bound(node, safe)
            steps.append(("exec", ast.unparse(node), "the tests"))
            continue
        name = f"test {len(asserts) + 1}"
        try:
            judge = judged(node.test, defined, safe)
        except InputError as e:
            raise InputError(f"tests: {name} `{ast.unparse(node.test)[:80]}`: {e}") from None
        kind = "truth" if judge.alone else "value"
        asserts.append((judge, [len(steps) + 1 + k for k in range(len(judge.probes))]))
        steps += [(kind, probe, name) for probe in judge.probes]
    if not asserts:
        raise InputError("tests: no assert to check")
    return Plan(steps, asserts)
