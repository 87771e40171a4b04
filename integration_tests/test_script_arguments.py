"""Every command-line argument of every script in examples/, benchmarks/ and
integration_tests/ says what it does in --help (a `help=` on each
`add_argument` call; `help=argparse.SUPPRESS` marks an internal one)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(
    p
    for folder in ("examples", "benchmarks", "integration_tests")
    for p in (ROOT / folder).glob("*.py")
)


def _arguments_without_help(path: Path, root: Path = ROOT) -> list[str]:
    missing = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument"
            and not any(k.arg == "help" for k in node.keywords)
        ):
            names = [a.value for a in node.args if isinstance(a, ast.Constant)]
            missing.append(f"{path.relative_to(root)}:{node.lineno} {names}")
    return missing


def test_the_scripts_are_found() -> None:
    names = {p.name for p in SCRIPTS}
    assert {"train_gpt2.py", "gpt2_gemini.py", "gemini.py", "_training.py"} <= names


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_argument_has_help(path: Path) -> None:
    assert _arguments_without_help(path) == []


def test_an_argument_without_help_is_reported(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text(
        "import argparse\nap = argparse.ArgumentParser()\n"
        "ap.add_argument('--steps', type=int)\nap.add_argument('--lr', help='the rate')\n"
    )
    assert _arguments_without_help(script, root=tmp_path) == ["s.py:3 ['--steps']"]
