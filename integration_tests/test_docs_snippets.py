"""Every code block of the documentation (docs/**/*.md) runs, or is checked.

- ```python: executed on the CPU. The blocks of one page run in order, in one
  namespace, in a fresh temporary directory, under the environment of a
  one-process torchrun (RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, MASTER_ADDR,
  MASTER_PORT). A warning raised from a snippet's own line (zerostack warns
  there when an option has no effect) fails it. A block preceded by the line
  `<!-- docs-test: compile -->` (it needs a GPU, several ranks, a download or
  files of the user's) is compiled only; its imports from zerostack must
  exist, and so must every keyword it passes to them.
- A fence with `title="NAME"` (any language) is also written to the file NAME
  in that directory, so that a bash or python block may use it.
- ```bash: every command is checked: scripts and paths exist in the
  repository (or are a titled block of the page), `python -m` modules and
  nox sessions exist, pip installs name packages and extras of this
  repository; other commands must be known ones.
- ```json: parsed. ```text and ```mermaid: not checked.

All pages run in one worker process (torch is imported once); each page gets
its own namespace, directory and process group.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import inspect
import itertools
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import tomllib
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
MARKER = re.compile(r"<!--\s*docs-test:\s*(\w+)\s*-->")
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,})(?P<info>.*)$")
LANGUAGES = {"python", "bash", "json", "text", "mermaid"}
# Commands a bash block may name besides those checked one by one below.
KNOWN_COMMANDS = {"apt-get", "cd", "export", "git", "mkdir", "mkdocs", "ruff", "tar"}


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    title: str | None
    mode: str  # "run" or "compile" (python only)
    code: str

    @property
    def where(self) -> str:
        return f"docs/{self.page}:{self.line}"


def blocks(page: str) -> list[Block]:
    """The fenced code blocks of a page, with their language, title and marker."""
    lines = (DOCS / page).read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        info, fence, indent = m["info"].strip(), m["fence"], len(m["indent"])
        lang = info.split()[0] if info else ""
        title = re.search(r'title="([^"]+)"', info)
        mode = "run"
        prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.search(prev)
        if marker:
            mode = marker[1]
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        code = "\n".join(line[indent:] for line in lines[i + 1 : end])
        found.append(Block(page, i + 1, lang, title[1] if title else None, mode, code + "\n"))
        i = end + 1
    return found


# -- the worker: runs the python blocks of every page ------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_page(page: str) -> str | None:
    """Run a page's python blocks; None, or what went wrong."""
    import torch.distributed as dist

    page_blocks = blocks(page)
    todo = [b for b in page_blocks if b.lang == "python"]
    if not any(b.mode == "run" for b in todo):
        return None
    old_cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="docs-snippets-") as tmp:
        os.chdir(tmp)
        os.environ["MASTER_PORT"] = str(_free_port())
        for b in page_blocks:
            if b.title:
                Path(tmp, b.title).write_text(b.code)
        namespace = {"__name__": "__main__"}
        try:
            for b in todo:
                if b.mode != "run":
                    continue
                code = compile(b.code, b.where, "exec")
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    exec(code, namespace)
                mine = [w for w in caught if w.filename == b.where]
                if mine:
                    w = mine[0]
                    return f"{b.where} (line {w.lineno} of the block) warns: {w.message}"
        except BaseException:
            return traceback.format_exc()
        finally:
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
            os.chdir(old_cwd)
    return None


def _worker(pages: list[str]) -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.update(LOCAL_WORLD_SIZE="1", GROUP_RANK="0")
    results = {page: _run_page(page) for page in pages}
    print("DOCS-SNIPPETS " + json.dumps(results))


@pytest.fixture(scope="module")
def page_results() -> dict[str, str | None]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, __file__, *PAGES],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("DOCS-SNIPPETS "):
            return json.loads(line.removeprefix("DOCS-SNIPPETS "))
    pytest.fail(f"the snippet worker died (exit {proc.returncode}):\n{proc.stderr[-5000:]}")


@pytest.mark.parametrize("page", PAGES)
def test_python_blocks_run(page: str, page_results: dict[str, str | None]) -> None:
    error = page_results[page]
    assert error is None, f"docs/{page}: a python block failed:\n{error}"


# -- checks made in this process --------------------------------------------------------


@pytest.mark.parametrize("page", PAGES)
def test_blocks_have_a_known_language(page: str) -> None:
    for b in blocks(page):
        assert b.lang in LANGUAGES, f"{b.where}: fence language {b.lang!r}; use {LANGUAGES}"
        assert b.mode in ("run", "compile"), f"{b.where}: unknown marker docs-test: {b.mode}"
        assert b.mode == "run" or b.lang == "python", f"{b.where}: a marker on a {b.lang} block"


def _zerostack_imports(tree: ast.AST, where: str) -> dict[str, object]:
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zerostack."):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), (
                    f"{where}: {node.module} has no {alias.name} (line {node.lineno})"
                )
                names[alias.asname or alias.name] = getattr(module, alias.name)
    return names


def _check_keywords(tree: ast.AST, names: dict[str, object], where: str) -> None:
    """Every keyword passed to a zerostack callable (or one of its methods) exists."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.keywords:
            continue
        func = node.func
        target = None
        if isinstance(func, ast.Name) and func.id in names:
            target, label = names[func.id], func.id
        elif (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id in names
        ):
            target = getattr(names[func.value.id], func.attr, None)
            label = f"{func.value.id}.{func.attr}"
            assert target is not None, f"{where}: {label} does not exist (line {node.lineno})"
        if target is None:
            continue
        params = inspect.signature(target).parameters
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            continue
        for kw in node.keywords:
            if kw.arg is not None:
                assert kw.arg in params, (
                    f"{where}: {label}() has no argument {kw.arg!r} (line {node.lineno})"
                )


@pytest.mark.parametrize("page", PAGES)
def test_python_blocks_compile_and_name_real_apis(page: str) -> None:
    for b in blocks(page):
        if b.lang != "python":
            continue
        tree = ast.parse(b.code, b.where)
        compile(tree, b.where, "exec")
        _check_keywords(tree, _zerostack_imports(tree, b.where), b.where)


@pytest.mark.parametrize("page", PAGES)
def test_json_blocks_parse(page: str) -> None:
    for b in blocks(page):
        if b.lang == "json":
            try:
                json.loads(b.code)
            except json.JSONDecodeError as error:
                pytest.fail(f"{b.where}: {error}")


def _nox_sessions() -> set[str]:
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and any("session" in ast.unparse(d) for d in node.decorator_list)
    }


def _distributions() -> dict[str, set[str]]:
    """Each package's distribution name -> its extras."""
    out = {}
    for pyproject in ROOT.glob("packages/*/pyproject.toml"):
        project = tomllib.loads(pyproject.read_text())["project"]
        out[project["name"]] = set(project.get("optional-dependencies", {}))
    return out


def _check_pip_install(args: list[str], where: str) -> None:
    dists = _distributions()
    for arg in args:
        if arg.startswith("-") or arg == "install":
            continue
        name, extras = re.fullmatch(r"([^\[]+)(?:\[([^\]]*)\])?(.*)", arg).group(1, 2)
        if "/" in name or name.startswith("."):
            path = ROOT / name
            assert path.exists(), f"{where}: pip install {arg}: {name} does not exist"
            pyproject = path / "pyproject.toml"
            if extras and pyproject.exists():
                known = tomllib.loads(pyproject.read_text())["project"].get(
                    "optional-dependencies", {}
                )
                for extra in extras.split(","):
                    assert extra in known, f"{where}: {name} has no extra [{extra}]"
            continue
        base = re.split(r"[<>=!~ ]", name)[0]
        if base.startswith("zerostack"):
            assert base in dists, f"{where}: no package of this repository is named {base}"
            for extra in (extras or "").split(",") if extras else []:
                assert extra in dists[base], f"{where}: {base} has no extra [{extra}]"


def _check_command(tokens: list[str], page_files: set[str], where: str) -> None:
    while tokens and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", tokens[0]):
        tokens = tokens[1:]  # VAR=value prefixes
    if not tokens:
        return
    cmd, args = tokens[0], tokens[1:]

    def script_exists(path: str) -> None:
        assert (ROOT / path).exists() or path in page_files, (
            f"{where}: {cmd} {path}: no such file in the repository or titled block on the page"
        )

    if cmd in ("python", "python3"):
        if args[:1] == ["-m"]:
            module, rest = args[1], args[2:]
            if module == "pip":
                return _check_command(["pip", *rest], page_files, where)
            if module in ("nox", "pytest"):
                return _check_command([module, *rest], page_files, where)
            assert importlib.util.find_spec(module) is not None, f"{where}: no module {module}"
        elif args:
            script_exists(next(a for a in args if not a.startswith("-")))
    elif cmd == "pip":
        if args[:1] == ["install"]:
            _check_pip_install(args[1:], where)
    elif cmd == "nox":
        sessions = _nox_sessions()
        for flag, value in itertools.pairwise(args):
            if flag in ("-s", "--session", "--sessions"):
                name = value.split("(")[0]
                assert name in sessions, f"{where}: nox has no session {name!r} ({sessions})"
    elif cmd == "torchrun":
        script_exists(next(a for a in args if a.endswith(".py")))
    elif cmd == "pytest":
        for a in args:
            if not a.startswith("-") and "/" in a:
                script_exists(a.split("::")[0])
    else:
        assert cmd in KNOWN_COMMANDS, f"{where}: unknown command {cmd!r}"


@pytest.mark.parametrize("page", PAGES)
def test_bash_blocks_name_real_commands(page: str) -> None:
    page_blocks = blocks(page)
    page_files = {b.title for b in page_blocks if b.title}
    for b in page_blocks:
        if b.lang != "bash":
            continue
        for n, line in enumerate(b.code.replace("\\\n", " ").splitlines()):
            tokens = shlex.split(line, comments=True)
            command: list[str] = []
            for token in [*tokens, "&&"]:
                if token in ("&&", "||", ";", "|"):
                    _check_command(command, page_files, f"{b.where} (line {n + 1} of the block)")
                    command = []
                else:
                    command.append(token)


@pytest.mark.parametrize("page", PAGES)
def test_tables_stand_apart(page: str) -> None:
    """Markdown renders a table only when blank lines part it from the text
    around it (and from another table); otherwise it shows as raw pipes."""
    lines = (DOCS / page).read_text().splitlines()
    in_fence = False
    for i, line in enumerate(lines[1:], start=1):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        if in_fence:
            continue
        prev, nxt = lines[i - 1], lines[i + 1] if i + 1 < len(lines) else ""
        header = line.startswith("|") and re.fullmatch(r"\|[-| :]+\|", nxt.strip())
        where = f"docs/{page}:{i + 1}"
        assert not (header and prev.strip()), f"{where}: put a blank line before the table"
        assert not (prev.startswith("|") and line.strip() and not line.startswith("|")), (
            f"{where}: put a blank line after the table"
        )


# -- the migration tables against the code -----------------------------------------------

ROW = re.compile(r"^\| `(?P<key>[^`]+)`(?P<note>[^|]*)\| (?P<value>[^|]*?) *\|", re.M)


def _rows(page: str, section: str | None = None) -> dict[str, str]:
    """First-column name -> second-column text of every table row of a page,
    or of its ``## `` section whose title contains ``section``."""
    text = (DOCS / page).read_text()
    if section is not None:
        parts = [p for p in re.split(r"^## ", text, flags=re.M) if section in p.split("\n", 1)[0]]
        assert parts, f"docs/{page}: no section titled with {section!r}"
        text = "\n".join(parts)
    return {m["key"]: m["value"] for m in ROW.finditer(text)}


def test_deepspeed_table_has_every_key_the_code_knows() -> None:
    """A row for every key of every rule table of zerostack.booster's DeepSpeed
    reader ([Note: DeepSpeed keys]); a key accepted silently at one value
    shows that value in the second column."""
    from zerostack.booster._plugins import _deepspeed

    rows = _rows("migration/deepspeed.md")
    prefix = {"": "", "zero_optimization": "", "bf16": "bf16.", "fp16": "fp16."}
    prefix |= {"zero_optimization.offload_optimizer": "offload_optimizer."}
    prefix |= {"activation_checkpointing": "activation_checkpointing."}
    for section, rules in _deepspeed.RULES.items():
        for key, rule in rules.items():
            name = prefix[section] + key
            assert name in rows, f"docs/migration/deepspeed.md: no row for {name}"
            shown = rows[name].split()[0] if rows[name] else ""
            quiet = getattr(rule, "default", getattr(rule, "quiet", _deepspeed._ALWAYS))
            expected = "" if quiet is _deepspeed._ALWAYS else json.dumps(quiet)
            assert shown == expected, (
                f"docs/migration/deepspeed.md: {name} is accepted silently at {expected or 'no value'} "
                f"in the code (got {shown!r})"
            )
    for name in _deepspeed._OFF_ONLY:
        assert name in rows, f"docs/migration/deepspeed.md: no row for {name}"
    # The mapped keys really map (none of them is reported).
    config = {
        "zero_optimization": {
            "stage": 2, "reduce_bucket_size": 2**20, "overlap_comm": False, "cpu_offload": False,
            "offload_optimizer": {"device": "cpu", "pin_memory": False},
            "offload_param": {"device": "none"}, "allgather_bucket_size": 2**19,
        },
        "fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 10,
                 "hysteresis": 1, "min_loss_scale": 2},
        "gradient_clipping": 1.0, "communication_data_type": "fp32",
        "zero_allow_untested_optimizer": True, "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
        "activation_checkpointing": {"cpu_checkpointing": True},
    }  # fmt: skip
    kwargs, settings = _deepspeed.read_deepspeed_config(config, world_size=1)
    assert kwargs["initial_scale"] == 2**8 and kwargs["cpu_offload"] and kwargs["max_norm"] == 1.0
    assert kwargs["reduce_bucket_size_in_m"] == 0.5 and settings.cpu_checkpointing
    assert settings.gradient_accumulation_steps == 2 and settings.scheduler is not None


def _assert_signature_rows(page: str, obj: object, skip: tuple[str, ...] = ()) -> None:
    """Each argument of ``obj`` has a row, with its default, in the page's
    section that names ``obj``."""
    import torch

    rows = _rows(page, section=obj.__name__)
    for name, param in inspect.signature(obj).parameters.items():
        if name in skip:
            continue
        assert name in rows, f"docs/{page}: no row for {obj.__name__}'s argument {name}"
        shown = rows[name].strip("`")
        assert eval(shown, {"torch": torch}) == param.default, (  # Python literals, torch's too
            f"docs/{page}: {obj.__name__}({name}=...) defaults to {param.default!r} "
            f"(got {rows[name]!r})"
        )


def test_colossalai_tables_have_every_argument() -> None:
    from zerostack.booster import GeminiPlugin
    from zerostack.fused_adam import HybridAdam

    _assert_signature_rows("migration/colossalai.md", GeminiPlugin)
    _assert_signature_rows("migration/colossalai.md", HybridAdam, skip=("params",))
    assert "params" in _rows("migration/colossalai.md")
    from zerostack.booster import ColoInitContext, LazyInitContext

    _assert_signature_rows("migration/colossalai.md", LazyInitContext)
    _assert_signature_rows("migration/colossalai.md", ColoInitContext)


# -- the checks themselves catch mistakes ------------------------------------------------

BAD_PAGE = """
```python
import warnings
warnings.warn("an option has no effect")
```

<!-- docs-test: compile -->
```python
from zerostack.fused_adam import HybridAdam
HybridAdam(params, learning_rate=1e-3)
```

```bash
python examples/no_such_script.py --smoke
nox -s no_such_session
pip install './packages/fused-adam[no-such-extra]'
```
"""


def test_the_checks_catch_mistakes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "bad.md").write_text(BAD_PAGE)
    monkeypatch.setattr(sys.modules[__name__], "DOCS", tmp_path)
    monkeypatch.setenv("MASTER_PORT", "0")
    assert "warns: an option has no effect" in _run_page("bad.md")
    (tmp_path / "raise.md").write_text("```python\nraise KeyError('from a snippet')\n```\n")
    assert "KeyError: 'from a snippet'" in _run_page("raise.md")
    with pytest.raises(AssertionError, match="has no argument 'learning_rate'"):
        test_python_blocks_compile_and_name_real_apis("bad.md")
    with pytest.raises(AssertionError, match=r"no_such_script\.py: no such file"):
        test_bash_blocks_name_real_commands("bad.md")
    for line, match in [
        ("nox -s no_such_session", "nox has no session 'no_such_session'"),
        ("pip install './packages/fused-adam[no-such-extra]'", "has no extra \\[no-such-extra\\]"),
        ("curl https://example.com", "unknown command 'curl'"),
    ]:
        (tmp_path / "bash.md").write_text(f"```bash\n{line}\n```\n")
        with pytest.raises(AssertionError, match=match):
            test_bash_blocks_name_real_commands("bash.md")


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        _worker(sys.argv[1:])
