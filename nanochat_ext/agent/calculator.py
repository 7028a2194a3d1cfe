"""The calculator tool nanochat's models call inside a reply (`<|python_start|>expr<|python_end|>`): the text
nanochat's `use_calculator` (engine.py at 92d63d4) gives for every arithmetic and string-count expression it
accepts, and a refusal (None) wherever it refuses; it refuses a little more (string methods outside `METHODS`, such
as `zfill` or `rjust`, which nanochat's eval would run). It never calls `eval`: the expression is parsed with `ast` and
only a whitelist of nodes is evaluated (numbers and arithmetic; string literals, a few pure string methods,
and/or/not/in), with numbers and strings bounded in size, so nothing an expression says can run code, and it runs in any
thread.

nanochat's rules, kept: every comma is removed first (`1,200` is 1200, `1,2` is 12). An expression of the
characters `0-9*+-/.() ` is arithmetic, refused if it holds `**`. Anything else may use only letters, digits,
quotes, `()._` and spaces, must call `.count(`, and must not contain `__`, `import`, `eval`, `open`, `dir`, ...
(as substrings, any case: `'profile'` is refused). An expression that fails (division by zero, `08`, a name)
is refused. Where nanochat would crash (an integer of more than 4300 digits, which `str()` refuses), or where an
expression would build a huge value, this refuses instead.
"""
from __future__ import annotations

import ast
import operator
import warnings

ARITHMETIC_CHARS = set("0123456789*+-/.() ")
STRING_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789'\"()._ ")
DANGEROUS = ("__", "import", "exec", "eval", "compile", "open", "file", "input", "raw_input", "globals", "locals",
             "vars", "dir", "getattr", "setattr", "delattr", "hasattr")
MAX_DIGITS = 4300  # Python's own limit for str() of an int (nanochat's Engine would crash past it)
MAX_CHARS = 10_000  # longest string or text a result may have

BIN_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv}
UNARY_OPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
# Methods of str (and bytes, tuple, numbers) that compute a bounded value from their receiver and arguments.
METHODS = {"count", "lower", "upper", "strip", "lstrip", "rstrip", "title", "capitalize", "casefold", "swapcase",
           "find", "rfind", "index", "rindex", "startswith", "endswith", "split", "rsplit", "splitlines", "partition",
           "rpartition", "join", "isdigit", "isalpha", "isalnum", "isspace", "islower", "isupper", "istitle",
           "isnumeric", "isdecimal", "isascii", "bit_length", "is_integer", "real", "imag", "numerator",
           "denominator"}
COMPARE_OPS = {ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b, ast.Is: operator.is_,
               ast.IsNot: operator.is_not}


# The model's text ('1else') parses with a SyntaxWarning, not the user's to read: the warnings of what the calculator
# parses, and only those, are ignored (one filter for the process: catch_warnings is not thread-safe, and the
# rollout thread calculates)
PARSED_AS = "<calculator>"
warnings.filterwarnings("ignore", category=SyntaxWarning, module=PARSED_AS)


class Refused(Exception):
    """The expression is outside what the calculator evaluates (nanochat: use_calculator returned None)."""


def calculate(expr: str) -> str | None:
    """The text the calculator answers `expr` with (what nanochat forces: `str()` of use_calculator's value),
    or None where it refuses."""
    expr = expr.replace(",", "")
    if set(expr) <= ARITHMETIC_CHARS:
        if "**" in expr:
            return None
        string_ops = False
    elif set(expr) <= STRING_CHARS and ".count(" in expr and not any(p in expr.lower() for p in DANGEROUS):
        string_ops = True
    else:
        return None
    try:
        value = Evaluator(string_ops).visit(ast.parse(expr, PARSED_AS, mode="eval").body)
        text = None if value is None else str(value)
    except Exception:  # any failure of a whitelisted node (an int's .lower, a bad literal): refused, as nanochat's
        return None  # eval_with_timeout returns None for any exception
    return text if text is None or len(text) <= MAX_CHARS else None


class Evaluator(ast.NodeVisitor):
    """Evaluates the nodes an accepted expression may hold; any other node is Refused. string_ops: nanochat's
    second branch (string methods, and/or/not/in) rather than arithmetic."""

    def __init__(self, string_ops: bool):
        self.string_ops = string_ops

    def generic_visit(self, node: ast.AST):
        raise Refused(type(node).__name__)

    def visit_Constant(self, node: ast.Constant):
        if not self.string_ops and not isinstance(node.value, (int, float, type(...))):
            raise Refused("constant")
        return bounded(node.value)

    def visit_Tuple(self, node: ast.Tuple):
        if node.elts:  # commas are removed before parsing: only () gets here
            raise Refused("tuple")
        return ()

    def visit_BinOp(self, node: ast.BinOp):
        if self.string_ops or type(node.op) not in BIN_OPS:
            raise Refused("operator")
        left, right = self.visit(node.left), self.visit(node.right)
        if isinstance(node.op, ast.Mult) and all(isinstance(v, int) for v in (left, right)):
            if left.bit_length() + right.bit_length() > 4 * MAX_DIGITS:  # refused before it is computed
                raise Refused("too large")
        return bounded(BIN_OPS[type(node.op)](left, right))

    def visit_UnaryOp(self, node: ast.UnaryOp):
        if isinstance(node.op, ast.Not) and self.string_ops:
            return not self.visit(node.operand)
        if self.string_ops or type(node.op) not in UNARY_OPS:
            raise Refused("operator")
        return UNARY_OPS[type(node.op)](self.visit(node.operand))

    def visit_BoolOp(self, node: ast.BoolOp):
        if not self.string_ops:
            raise Refused("boolean")
        value = None
        for operand in node.values:  # short-circuits as Python does: the value that decided
            value = self.visit(operand)
            if bool(value) == isinstance(node.op, ast.Or):
                return value
        return value

    def visit_IfExp(self, node: ast.IfExp):
        if not self.string_ops:
            raise Refused("conditional")
        return self.visit(node.body) if self.visit(node.test) else self.visit(node.orelse)

    def visit_Compare(self, node: ast.Compare):
        if not self.string_ops or any(type(op) not in COMPARE_OPS for op in node.ops):
            raise Refused("comparison")
        left = self.visit(node.left)
        for op, comparator in zip(node.ops, node.comparators):
            right = self.visit(comparator)
            if not COMPARE_OPS[type(op)](left, right):
                return False
            left = right
        return True

    def visit_Attribute(self, node: ast.Attribute):
        if not self.string_ops or node.attr not in METHODS:
            raise Refused("attribute")
        return getattr(self.visit(node.value), node.attr)

    def visit_Call(self, node: ast.Call):
        if not self.string_ops or not isinstance(node.func, ast.Attribute) or node.keywords:
            raise Refused("call")
        method = self.visit(node.func)
        return bounded(method(*(self.visit(a) for a in node.args)))


def bounded(value):
    """value, or Refused where it is a number or a sequence too large to answer with."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 3.33 * MAX_DIGITS:
        raise Refused("too many digits")
    if isinstance(value, (str, bytes, tuple, list)) and len(value) > MAX_CHARS:
        raise Refused("too long")
    return value
