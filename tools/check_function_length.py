"""No function longer than 80 lines in the packages (run by `nox -s lint`).

A function is measured from its `def` line to its last line, docstring,
comments and blank lines included (decorators not counted). Every function
and method counts, nested ones too, in every package's `src/` and `tests/`
(packages/testing included): a test over 80 lines is as hard to review as a
method. Prints `path:line: name is N lines (limit 80)` for each one over the
limit and exits 1 when there is one.

Usage: python tools/check_function_length.py [PATH ...]
(files or folders; by default packages/*/src and packages/*/tests)
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

LIMIT = 80
ROOT = Path(__file__).resolve().parent.parent


def long_functions(source: str, limit: int = LIMIT) -> Iterator[tuple[int, str, int]]:
    """(line of the `def`, qualified name, length) of each function in
    `source` longer than `limit` lines."""

    def visit(node: ast.AST, prefix: str) -> Iterator[tuple[int, str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                length = (child.end_lineno or child.lineno) - child.lineno + 1
                if length > limit:
                    yield child.lineno, name, length
                yield from visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, f"{prefix}{child.name}.")
            else:
                yield from visit(child, prefix)

    yield from visit(ast.parse(source), "")


def _files(args: list[str]) -> list[Path]:
    if not args:
        return sorted(
            p for pattern in ("packages/*/src/**/*.py", "packages/*/tests/**/*.py")
            for p in ROOT.glob(pattern)
        )  # fmt: skip
    files: list[Path] = []
    for arg in map(Path, args):
        files += sorted(arg.rglob("*.py")) if arg.is_dir() else [arg]
    return files


def main(args: list[str]) -> int:
    found = 0
    for path in _files(args):
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        for line, name, length in long_functions(path.read_text(encoding="utf-8")):
            print(f"{shown}:{line}: {name} is {length} lines (limit {LIMIT})")
            found += 1
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
