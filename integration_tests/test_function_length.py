"""tools/check_function_length.py run as `nox -s lint` runs it, on files
made here: what it counts, what it prints and its exit status."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _check(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "tools/check_function_length.py", *map(str, paths)],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip


def _function(name: str, body_lines: int, indent: str = "") -> str:
    """A function of exactly 1 + `body_lines` lines: its def, a docstring
    line, then statements."""
    body = [f'{indent}    """Doc."""'] + [f"{indent}    x{i} = {i}" for i in range(body_lines - 1)]
    return "\n".join([f"{indent}def {name}():", *body]) + "\n"


def test_80_lines_pass_and_81_fail_docstring_included(tmp_path):
    ok = tmp_path / "ok.py"
    ok.write_text(_function("fits", 79))
    out = _check(ok)
    assert out.returncode == 0, out.stdout
    assert out.stdout == ""

    long = tmp_path / "long.py"
    long.write_text("import os\n\n\n" + _function("too_long", 80))
    out = _check(long)
    assert out.returncode == 1
    assert out.stdout == f"{long}:4: too_long is 81 lines (limit 80)\n"


def test_methods_nested_and_async_functions_are_named_and_counted(tmp_path):
    source = (
        "class Outer:\n"
        + _function("method", 85, indent="    ")
        + "\n\ndef host():\n"
        + _function("inner", 90, indent="    ")
        + "\n\n"
        + _function("fine", 10).replace("def ", "async def ")
        + "\n\n"
        + _function("slow", 81).replace("def ", "async def ")
    )
    path = tmp_path / "mod.py"
    path.write_text(source)
    lines = _check(tmp_path).stdout.splitlines()
    # host is 1 + inner's 91 lines; both are reported, inner under host.
    assert [line.split(": ", 1)[1] for line in lines] == [
        "Outer.method is 86 lines (limit 80)",
        "host is 92 lines (limit 80)",
        "host.inner is 91 lines (limit 80)",
        "slow is 82 lines (limit 80)",
    ]


def test_default_reads_every_package_src_and_tests():
    spec = importlib.util.spec_from_file_location("check", ROOT / "tools/check_function_length.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    read = {p.relative_to(ROOT).parts[1:3] for p in tool._files([])}
    folders = [p for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists()]
    assert "testing" in {p.name for p in folders}
    for folder in folders:
        for kind in ("src", "tests"):
            if (folder / kind).is_dir():
                assert (folder.name, kind) in read
