"""The documentation runs: every code block of README.md and docs/ is executed, the README
stays a short front door, tables render, and the generated settings table is current.

Blocks are found by parsing the markdown. What a block is decides how it runs:

* ``python``: run as a script; ``<!-- test: launch -n 3 [--backend B] -->`` on the line
  before the block runs it as a job of ``meshcomm launch`` instead;
* ``bash``/``sh``: run with ``bash -euo pipefail``;
* ``console``: the ``$ `` lines are run, and every output line shown must appear in the
  real output (``...`` matches anything);
* ``toml``/``json``: parsed;
* ``text``: output or a synopsis, not code.

``<!-- test: skip (REASON) -->`` before a block skips it and needs a reason; a page of
benchmark commands is skipped as a whole (``SKIP_FILES``) unless a block is marked. Blocks run in a
scratch folder holding links to the checkout's top-level entries, so files they write
are left nowhere.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None  # type: ignore[assignment]

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BIN = Path(sys.executable).parent
BLOCK_TIMEOUT = 300  # seconds for one block (a bound against hangs, not a performance check)
FILES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]

#: files whose blocks run only when marked ``<!-- test: run -->`` or ``launch``, and why
SKIP_FILES = {
    "docs/benchmarks.md": "its commands are benchmarks that run for minutes (tests/test_bench.py runs "
    "meshcomm bench on small sizes); the page belongs to whoever measures, who adds markers to run a block",
}
#: variables read by the code that are internal to a test or a protocol, not settings
INTERNAL_VARS = {"MESHCOMM_TEST_DIR", "MESHCOMM_SOCKETS_TEST_SEQ_START", "MESHCOMM_EOF_"}
README_MAX_LINES = 150
TWO_COMMANDS = (
    "bash scripts/demo.sh    # main job",
    "bash scripts/test.sh    # tests",
)

_MARKER = re.compile(r"^\s*<!--\s*test:\s*(.*?)\s*-->\s*$")
_FENCE = re.compile(r"^(\s*)(```|~~~)\s*([\w+-]*)\s*$")


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    marker: str | None  # the text after "test:" on the line before the block

    @property
    def rel(self) -> str:
        return self.path.relative_to(ROOT).as_posix()

    @property
    def first_line(self) -> str:
        return self.code.strip().splitlines()[0].strip() if self.code.strip() else ""

    @property
    def id(self) -> str:
        return f"{self.rel}:{self.line}:{self.lang or 'none'}"


def parse_blocks(path: Path, text: str | None = None) -> list[Block]:
    """Every fenced code block of a markdown file, with the ``test:`` marker before it."""
    lines = (path.read_text() if text is None else text).splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        j = i + 1
        body = []
        while j < len(lines) and not re.match(rf"^\s*{re.escape(fence)}\s*$", lines[j]):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        mark = _MARKER.match(lines[k]) if k >= 0 else None
        blocks.append(Block(path, i + 1, lang.lower(), "\n".join(body) + "\n", mark.group(1) if mark else None))
        i = j + 1
    return blocks


def all_blocks() -> list[Block]:
    return [b for f in FILES for b in parse_blocks(f)]


def skip_reason(block: Block) -> str | None:
    """Why the block is not run (None: it runs)."""
    if block.marker and block.marker.startswith("skip"):
        return block.marker[4:].strip(" ()") or None
    if block.rel in SKIP_FILES and not block.marker:
        return SKIP_FILES[block.rel]
    return None


# -- running one block ------------------------------------------------------------------------
def _scratch(tmp_path: Path) -> Path:
    """A folder that looks like the checkout (links to its entries) where blocks may write."""
    work = tmp_path / "work"
    work.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in {".git", ".venv", ".venv-mpich", "site", "dist", "build"}:
            (work / entry.name).symlink_to(entry)
    return work


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_", "MESHCOMM_"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        MLX_TIMEOUT="60",
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        OPENBLAS_NUM_THREADS="1",
    )
    return env


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run in its own session; on timeout kill the whole session, so nothing is left."""
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=BLOCK_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{argv} did not finish within {BLOCK_TIMEOUT} s:\n{out}") from None
    finally:
        try:  # what a failed block left behind (e.g. a background rank) goes with it
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(argv, proc.returncode, out, "")


def _expect_lines(shown: list[str], output: str, command: str) -> None:
    got = [" ".join(line.split()) for line in output.splitlines()]
    for line in shown:
        want = " ".join(line.split())
        if not want:
            continue
        pattern = re.compile(".*".join(re.escape(p) for p in want.split("...")))
        assert any(pattern.fullmatch(g) for g in got), (
            f"`{command}` did not print a line like {want!r}; it printed:\n{output}"
        )


def run_block(block: Block, work: Path) -> None:
    """Execute one block; raise AssertionError (with its output) when it fails."""
    where = f"{block.rel}:{block.line}"
    marker = block.marker or ""
    if block.lang in ("python", "py"):
        script = work / f"block_{block.line}.py"
        script.write_text(block.code)
        if marker.startswith("launch"):
            args = shlex.split(marker)[1:]
            argv = [str(BIN / "meshcomm"), "launch", *args, str(script)]
        else:
            argv = [sys.executable, str(script)]
        res = _run(argv, work)
        assert res.returncode == 0, f"python block at {where} failed (exit {res.returncode}):\n{res.stdout}"
        if "then register" in marker or "meshcomm_register_backends" in block.code:
            _register(script)
    elif block.lang in ("bash", "sh", "shell"):
        res = _run(["bash", "-euo", "pipefail", "-c", block.code], work)
        assert res.returncode == 0, f"bash block at {where} failed (exit {res.returncode}):\n{res.stdout}"
    elif block.lang == "console":
        command: str | None = None
        shown: list[str] = []
        for line in block.code.splitlines() + ["$ "]:
            if line.startswith("$ "):
                if command:
                    res = _run(["bash", "-euo", "pipefail", "-c", command], work)
                    assert res.returncode == 0, f"`{command}` at {where} failed:\n{res.stdout}"
                    _expect_lines(shown, res.stdout, command)
                command, shown = line[2:].strip(), []
            else:
                shown.append(line)
    elif block.lang == "toml":
        if tomllib is None:
            pytest.skip("tomllib needs Python 3.11")
        tomllib.loads(block.code)
    elif block.lang == "json":
        json.loads(block.code)
    else:
        raise AssertionError(f"{where}: no way to run a {block.lang!r} block")


def _register(script: Path) -> None:
    """A plugin example's hook must be accepted by the core's real ``register``."""
    from meshcomm.runtime.registry import BackendRegistrar, Registry

    spec = importlib.util.spec_from_file_location(f"docs_block_{script.stem}", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    registry = Registry()
    module.meshcomm_register_backends(register=BackendRegistrar(registry))
    assert registry.specs, f"{script}: the hook registered no backend"


# -- the tests -----------------------------------------------------------------------------
CODE_LANGS = {"python", "py", "bash", "sh", "shell", "console", "toml", "json"}
_RUNNABLE = [b for b in all_blocks() if b.lang in CODE_LANGS and skip_reason(b) is None]


@pytest.mark.parametrize("block", _RUNNABLE, ids=[b.id for b in _RUNNABLE])
def test_block_runs(block: Block, tmp_path: Path) -> None:
    run_block(block, _scratch(tmp_path))


def test_every_block_is_run_or_skipped_with_a_reason() -> None:
    problems = []
    skipped = []
    for b in all_blocks():
        if b.lang not in CODE_LANGS | {"text"} and skip_reason(b) is None:
            problems.append(f"{b.id}: give the block a language (text for output or a synopsis)")
        if b.marker is not None and not re.match(r"^(run|launch\s+-n\s+\d+|skip\s*\(.+\))", b.marker):
            problems.append(f"{b.id}: unknown marker {b.marker!r} (run, launch -n N ..., skip (reason))")
        if b.lang in CODE_LANGS and skip_reason(b) is not None:
            if b.rel not in SKIP_FILES:
                skipped.append(b.id)
    assert not problems, "\n".join(problems)
    assert len(skipped) <= 12, f"the skip list grew to {len(skipped)}: {skipped}"


def test_a_broken_block_fails(tmp_path: Path) -> None:
    """The runner really fails: a python block that raises, a bash block that exits 1, a
    console block whose output differs, and a launched block where one rank fails."""
    work = _scratch(tmp_path)
    text = (
        "```python\nraise SystemExit('broken on purpose')\n```\n\n"
        "```bash\necho hi\nfalse\necho never\n```\n\n"
        "```console\n$ echo hello\ngoodbye\n```\n\n"
        "<!-- test: launch -n 2 -->\n```python\nimport meshcomm as mc\n"
        "assert mc.init().rank() == 0, 'rank 1 breaks'\n```\n"
    )
    blocks = parse_blocks(ROOT / "README.md", text)
    assert [b.lang for b in blocks] == ["python", "bash", "console", "python"]
    assert blocks[3].marker == "launch -n 2"
    for b in blocks:
        with pytest.raises(AssertionError):
            run_block(b, work)


def test_readme_is_a_short_front_door() -> None:
    """At most README_MAX_LINES lines, not counting the generated list of variable names
    (it grows with every setting), and the two commands exactly as .ci/run relies on them."""
    text = (ROOT / "README.md").read_text()
    hooks = _hooks()
    begin, end = text.find(hooks.NAMES_BEGIN), text.find(hooks.NAMES_END)
    names = text[begin:end].count("\n") - 1 if 0 <= begin < end else 0
    lines = len(text.splitlines()) - max(names, 0)
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines besides the variable list"
    for line in TWO_COMMANDS:
        assert line in text, f"README.md lost the command {line!r}"


def _cells(row: str) -> int:
    row = re.sub(r"`[^`]*`", "code", row.strip())  # pipes inside code spans do not split cells
    return len(re.split(r"(?<!\\)\|", row.strip().strip("|")))


def test_tables_render() -> None:
    """Every table starts with a header and a separator, and no blank line splits one (its
    rows after the gap would render as plain text)."""
    problems = []
    for f in FILES:
        lines = f.read_text().splitlines()
        fenced, i = False, 0
        while i < len(lines):
            if _FENCE.match(lines[i]):
                fenced = not fenced
            if fenced or not lines[i].lstrip().startswith("|"):
                i += 1
                continue
            start = i
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                i += 1
            rows = [r.strip() for r in lines[start:i]]
            where = f"{f.relative_to(ROOT)}:{start + 1}"
            if len(rows) < 2 or not re.fullmatch(r"\|?(\s*:?-{3,}:?\s*\|)+\s*:?-*:?\s*\|?", rows[1]):
                problems.append(f"{where}: table rows without a header and separator (a split table?)")
                continue
            width = _cells(rows[0])
            problems += [
                f"{where}: row {n + 1} has {_cells(r)} cells, the header {width}"
                for n, r in enumerate(rows)
                if _cells(r) != width
            ]
    assert not problems, "\n".join(problems)


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts" / "docs_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_settings_table_is_current() -> None:
    """The generated parts committed in the markdown match what the build renders."""
    hooks = _hooks()
    for page, render in (("settings.md", hooks.with_settings_table), ("tuning.md", hooks.with_tuning_table)):
        text = (DOCS / page).read_text()
        assert render(text) == text, (
            f"docs/{page}'s table differs from the pydantic models: run .venv/bin/python scripts/docs_hooks.py --write"
        )
    readme = (ROOT / "README.md").read_text()
    assert hooks.with_variable_names(readme) == readme, (
        "README.md's list of variables differs from docs/settings.md: run "
        ".venv/bin/python scripts/docs_hooks.py --write"
    )


def test_settings_page_names_every_variable() -> None:
    """Every MLX_*/MESHCOMM_* name the code reads is on the settings page or, for the
    knobs users need not turn, on the tuning page; no variable is on both tables."""
    hooks = _hooks()
    users = hooks.settings_table()
    knobs = hooks.settings_table(tuning=True)
    both = sorted(set(re.findall(r"^\| `(\w+)`", users, re.M)) & set(re.findall(r"^\| `(\w+)`", knobs, re.M)))
    assert not both and "MESHCOMM_SOCKETS_CHUNK_KIB" in knobs and "MLX_TIMEOUT" in users, both
    text = hooks.with_settings_table((DOCS / "settings.md").read_text()) + hooks.with_tuning_table(
        (DOCS / "tuning.md").read_text()
    )
    names = set()
    for folder in (ROOT / "core", ROOT / "plugins"):
        for py in folder.rglob("*.py"):
            names.update(re.findall(r"[\"']((?:MLX|MESHCOMM)_[A-Z0-9_]+)[\"']", py.read_text()))
    missing = sorted(n for n in names - INTERNAL_VARS if f"`{n}`" not in text and n not in text)
    assert not missing, f"neither docs/settings.md nor docs/tuning.md mentions {missing}"


def test_launch_page_matches_the_command_line() -> None:
    """Every option of `meshcomm launch --help` is on docs/launch.md, and the synopsis there
    names no option the command does not have."""
    page = (DOCS / "launch.md").read_text()
    res = _run([str(BIN / "meshcomm"), "launch", "--help"], ROOT)
    assert res.returncode == 0, res.stdout
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", res.stdout)) - {"--help"}
    synopsis = next(b for b in parse_blocks(DOCS / "launch.md") if b.first_line.startswith("meshcomm launch"))
    shown = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", synopsis.code))
    assert not sorted(f for f in flags if f not in page), "docs/launch.md lacks these options"
    assert not sorted(shown - flags), "the synopsis in docs/launch.md names options launch does not have"
