"""One-function bugs for the SWE task maker, in SWE-smith's way (its procedural
modifications: operators flipped or changed, constants shifted, arguments swapped,
statements removed): :func:`mutations` lists every candidate of a module's functions, each
an edit of one span of its source, so the gold fix is a small diff.

Kinds:

* ``flip_comparison``: ``<`` and ``>=``, ``>`` and ``<=``, ``==`` and ``!=``, ``in`` and ``not
  in``, ``is`` and ``is not`` exchanged;
* ``off_by_one``: a small integer constant (0-9) one more, or 1-9 one less;
* ``swap_arguments``: a call's two positional arguments exchanged;
* ``drop_statement``: an assignment, augmented assignment or call statement alone on its
  line removed (a ``pass`` in its place when it was the body's only statement);
* ``change_operator``: ``+`` and ``-``, ``*`` and ``//`` (``/``), ``and`` and ``or``
  exchanged; ``True`` and ``False``.

Only code inside function bodies (methods included) is touched, never a docstring, a
decorator or a default argument.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

_FLIP = {ast.Lt: ">=", ast.GtE: "<", ast.Gt: "<=", ast.LtE: ">", ast.Eq: "!=", ast.NotEq: "==",
         ast.In: "not in", ast.NotIn: "in", ast.Is: "is not", ast.IsNot: "is"}
_BINOP = {ast.Add: "-", ast.Sub: "+", ast.Mult: "//", ast.FloorDiv: "*", ast.Div: "*"}
_BOOL = {ast.And: "or", ast.Or: "and"}


@dataclass(frozen=True)
class Mutation:
    """One edit: the text between two (line, column) points replaced (lines 1-based,
    columns in characters)."""

    kind: str
    function: str  # qualified: Class.method
    line: int
    col: int
    end_line: int
    end_col: int
    replacement: str

    def apply(self, source: str) -> str:
        lines = source.splitlines(keepends=True)
        start = sum(len(x) for x in lines[:self.line - 1]) + self.col
        end = sum(len(x) for x in lines[:self.end_line - 1]) + self.end_col
        return source[:start] + self.replacement + source[end:]


def _chars(line: str, byte_col: int) -> int:
    """ast's columns are UTF-8 byte offsets; a character offset on ``line``."""
    return len(line.encode("utf-8")[:byte_col].decode("utf-8", "ignore"))


class _Finder(ast.NodeVisitor):
    def __init__(self, source: str) -> None:
        self.lines = source.splitlines(keepends=True)
        self.found: list[Mutation] = []
        self.scope: list[str] = []
        self.function = ""

    def _span(self, node) -> tuple[int, int, int, int]:
        return (node.lineno, _chars(self.lines[node.lineno - 1], node.col_offset),
                node.end_lineno, _chars(self.lines[node.end_lineno - 1], node.end_col_offset))

    def _text(self, node) -> str:
        line, col, end_line, end_col = self._span(node)
        if line == end_line:
            return self.lines[line - 1][col:end_col]
        return "".join([self.lines[line - 1][col:], *self.lines[line:end_line - 1],
                        self.lines[end_line - 1][:end_col]])

    def _add(self, kind: str, node, replacement: str) -> None:
        if self.function:
            self.found.append(Mutation(kind, self.function, *self._span(node), replacement))

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.scope.append(node.name)
        for stmt in node.body:
            self.visit(stmt)
        self.scope.pop()

    def visit_FunctionDef(self, node) -> None:
        outer = self.function
        self.function = ".".join([*self.scope, node.name])
        self.scope.append(node.name)
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            body = body[1:]  # the docstring stays
        self._statements(body)
        for stmt in body:
            self.visit(stmt)
        self.scope.pop()
        self.function = outer

    visit_AsyncFunctionDef = visit_FunctionDef

    def _statements(self, body: list[ast.stmt]) -> None:
        for stmt in body:
            droppable = isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign)) or (
                isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call))
            if not (droppable and stmt.lineno == stmt.end_lineno and self.function):
                continue
            if self.lines[stmt.lineno - 1].strip() != self._text(stmt).strip():
                continue  # not alone on its line
            if len(body) > 1:  # the whole line goes
                self.found.append(Mutation("drop_statement", self.function, stmt.lineno, 0,
                                           stmt.lineno + 1, 0, ""))
            else:
                self._add("drop_statement", stmt, "pass")

    def visit_Compare(self, node: ast.Compare) -> None:
        if len(node.ops) == 1 and type(node.ops[0]) in _FLIP:
            left, right = self._text(node.left), self._text(node.comparators[0])
            if "\n" not in left + right:
                self._add("flip_comparison", node,
                          f"{left} {_FLIP[type(node.ops[0])]} {right}")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        value = node.value
        if isinstance(value, bool):
            self._add("change_operator", node, str(not value))
        elif isinstance(value, int) and 0 <= value <= 9 and self._text(node) == str(value):
            self._add("off_by_one", node, str(value + 1))
            if value >= 1:
                self._add("off_by_one", node, str(value - 1))

    def visit_BinOp(self, node: ast.BinOp) -> None:
        if type(node.op) in _BINOP:
            left, right = self._text(node.left), self._text(node.right)
            if "\n" not in left + right and not isinstance(node.left, ast.BinOp) and \
                    not isinstance(node.right, ast.BinOp):
                self._add("change_operator", node, f"{left} {_BINOP[type(node.op)]} {right}")
        self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        parts = [self._text(v) for v in node.values]
        if len(parts) == 2 and "\n" not in "".join(parts):
            wrap = [f"({p})" if isinstance(v, ast.BoolOp) else p for p, v in zip(parts, node.values)]
            self._add("change_operator", node, f" {_BOOL[type(node.op)]} ".join(wrap))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        args = node.args
        if len(args) == 2 and not any(isinstance(a, ast.Starred) for a in args):
            a, b = self._text(args[0]), self._text(args[1])
            if a != b and "\n" not in a + b and args[0].end_lineno == args[1].lineno:
                line, col, _, _ = self._span(args[0])
                _, _, end_line, end_col = self._span(args[1])
                between = self.lines[line - 1][self._span(args[0])[3]:self._span(args[1])[1]]
                if between.strip() == ",":
                    self.found.append(Mutation("swap_arguments", self.function, line, col,
                                               end_line, end_col, f"{b}{between}{a}")
                                      if self.function else None)
        self.generic_visit(node)


def mutations(source: str) -> list[Mutation]:
    """Every candidate bug of ``source``'s functions, in source order; each applies to
    ``source`` alone (:meth:`Mutation.apply`) and leaves it valid Python."""
    finder = _Finder(source)
    finder.visit(ast.parse(source))
    out = []
    for m in finder.found:
        if m is None:
            continue
        try:
            ast.parse(m.apply(source))
        except SyntaxError:
            continue
        out.append(m)
    return out
