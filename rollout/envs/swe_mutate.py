"""Bugs injected into a package's functions by AST rewrites, in the manner of SWE-smith (`async-rl swe make`).

`sites(source, path)` lists every place in every function (methods included) where one of five rewrites applies:
a flipped comparison (`<` to `>=`, `==` to `!=`, `in` to `not in`, ...), an off-by-one (an integer constant n to
n + 1), a dropped branch (an `if` without `else` becomes `pass`), swapped arguments (a call's first two positional
arguments), a changed constant (True to False and back). Each `Mutation` replaces one node's exact source span (its
lines and columns from the AST), so the gold patch, the inverse diff, is a line or two.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

FLIP = {ast.Lt: ast.GtE, ast.LtE: ast.Gt, ast.Gt: ast.LtE, ast.GtE: ast.Lt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
        ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}


@dataclass(frozen=True)
class Mutation:
    path: str  # the file, relative to the repository's root
    function: str  # the qualified name of the function it is in
    kind: str  # flipped-comparison, off-by-one, dropped-branch, swapped-arguments, changed-constant
    start: int  # byte offsets of the replaced span in the file
    end: int
    replacement: str
    line: int

    def apply(self, source: str) -> str:
        data = source.encode()
        return (data[: self.start] + self.replacement.encode() + data[self.end:]).decode()


def sites(source: str, path: str) -> list[Mutation]:
    """Every mutation of `source`'s functions whose result parses and differs."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    data = source.encode()
    starts = [0]
    for line in data.splitlines(True):
        starts.append(starts[-1] + len(line))
    found: list[Mutation] = []

    def span(node: ast.AST) -> tuple[int, int]:
        return (starts[node.lineno - 1] + node.col_offset, starts[node.end_lineno - 1] + node.end_col_offset)

    def add(function: str, kind: str, node: ast.AST, replacement: str) -> None:
        start, end = span(node)
        mutation = Mutation(path, function, kind, start, end, replacement, node.lineno)
        mutated = mutation.apply(source)
        if mutated != source and _parses(mutated):
            found.append(mutation)

    def visit_function(function: ast.FunctionDef | ast.AsyncFunctionDef, qualname: str) -> None:
        docstring = ast.get_docstring(function, clean=False) is not None and function.body[0]
        for node in ast.walk(function):
            if node is docstring:
                continue
            if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in FLIP:
                flipped = ast.Compare(node.left, [FLIP[type(node.ops[0])]()], node.comparators)
                add(qualname, "flipped-comparison", node, ast.unparse(flipped))
            elif isinstance(node, ast.Constant) and type(node.value) is int:
                add(qualname, "off-by-one", node, str(node.value + 1))
            elif isinstance(node, ast.Constant) and type(node.value) is bool:
                add(qualname, "changed-constant", node, str(not node.value))
            elif isinstance(node, ast.If) and not node.orelse and node is not function:
                indent = " " * node.col_offset
                start = starts[node.lineno - 1]
                end = starts[node.end_lineno]
                mutation = Mutation(path, qualname, "dropped-branch", start, end, indent + "pass\n", node.lineno)
                if _parses(mutation.apply(source)):
                    found.append(mutation)
            elif (isinstance(node, ast.Call) and len(node.args) >= 2
                  and not any(isinstance(a, ast.Starred) for a in node.args[:2])):
                first, second = node.args[0], node.args[1]
                a, b = span(first), span(second)
                if b[0] >= a[1]:
                    text = data[a[0]:a[1]].decode(), data[a[1]:b[0]].decode(), data[b[0]:b[1]].decode()
                    if text[0] != text[2]:
                        mutation = Mutation(path, qualname, "swapped-arguments", a[0], b[1],
                                            text[2] + text[1] + text[0], first.lineno)
                        if _parses(mutation.apply(source)):
                            found.append(mutation)

    def walk(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                visit_function(node, prefix + node.name)
            elif isinstance(node, ast.ClassDef):
                walk(node.body, prefix + node.name + ".")

    walk(tree.body, "")
    return found


def _parses(source: str) -> bool:
    try:
        ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    return True


def remove_tests(source: str, names: set[tuple[str, ...]]) -> str:
    """`source` without the test functions named (("test_x",) or ("TestClass", "test_y")), decorators included; a
    class left empty gets `pass`."""
    tree = ast.parse(source)
    lines = source.splitlines(True)
    drop: list[tuple[int, int]] = []
    emptied: list[ast.ClassDef] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and (node.name,) in names:
            drop.append((_first_line(node), node.end_lineno))
        elif isinstance(node, ast.ClassDef):
            methods = [m for m in node.body if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef)
                       and (node.name, m.name) in names]
            drop.extend((_first_line(m), m.end_lineno) for m in methods)
            if methods and len(methods) == len(node.body):
                emptied.append(node)
    keep = [True] * len(lines)
    for first, last in drop:
        for i in range(first - 1, last):
            keep[i] = False
    passes = {_first_line(cls.body[0]) - 1: " " * cls.body[0].col_offset + "pass\n" for cls in emptied}
    return "".join(passes.get(i, "") + (line if keep[i] else "") for i, line in enumerate(lines))


def _first_line(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    return min([node.lineno] + [d.lineno for d in node.decorator_list])
