"""mkdocs hooks for the documentation site (mkdocs.yml) and the settings table's generator.

Five jobs, so that the site is built from the files people read on a checkout:

* the README is the site's home page (``index.md``), its links rewritten to the site;
* a link from a page to a file of the repository outside ``docs/`` (``scripts/demo.sh``,
  ``bench/results/compare.png``) is copied into the site under ``_repo/`` and the link
  points there, so strict mode still fails on a link to a file that does not exist;
* the settings tables are rendered from the pydantic models (the core's ``Config`` and
  every bundled backend's settings model) at build time, so they cannot drift from the
  code: the user's settings into ``docs/settings.md``, the knobs marked ``tuning`` into
  ``docs/tuning.md``; and the README's list of every variable name from the settings
  page. ``python scripts/docs_hooks.py --write`` writes them into the files for readers of
  the raw markdown; ``tests/test_docs.py`` fails when one is out of date;
* a page of docs/ that the nav of mkdocs.yml does not list is appended to the nav;
* the API reference drops the Sphinx roles of the docstrings (``:func:`x``` shows ``x``).
"""

from __future__ import annotations

import argparse
import re
import sys
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic import BaseModel

__all__ = [
    "BUNDLED",
    "TABLE_BEGIN",
    "TABLE_END",
    "settings_models",
    "settings_table",
    "with_settings_table",
    "with_tuning_table",
    "rewrite_links",
    "NAMES_BEGIN",
    "NAMES_END",
    "variable_names",
    "with_variable_names",
]

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
#: the distributions whose settings the table documents (third-party plugins document their own)
BUNDLED = ("meshcomm", "meshcomm-sockets", "meshcomm-mpi", "meshcomm-gloo")
TABLE_BEGIN = "<!-- settings-table:begin: generated from the pydantic models by scripts/docs_hooks.py, do not edit -->"
TABLE_END = "<!-- settings-table:end -->"
NAMES_BEGIN = "<!-- settings-names:begin: generated from docs/settings.md by scripts/docs_hooks.py, do not edit -->"
NAMES_END = "<!-- settings-names:end -->"
_REPO_PREFIX = "_repo/"
_LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")
_FENCE = re.compile(r"^\s*(```|~~~)")


# -- the settings table ---------------------------------------------------------------------
def settings_models() -> list[tuple[str, type[BaseModel]]]:
    """(section, model) for the core's Config and every bundled backend's settings model.

    Raises RuntimeError naming the missing backends when a bundled plugin is not installed
    (the table would silently lose its rows)."""
    from meshcomm.runtime.config import Config
    from meshcomm.runtime.registry import Registry

    registry = Registry().load(environ={})
    out: list[tuple[str, type[BaseModel]]] = [("core", Config)]
    found = set()
    for spec in sorted(registry.specs.values(), key=lambda s: (s.priority, s.name)):
        if spec.distribution in BUNDLED:
            found.add(spec.distribution)
            if spec.settings is not None:
                out.append((spec.name, spec.settings))
    missing = sorted(set(BUNDLED[1:]) - found)
    if missing:
        raise RuntimeError(
            f"the settings table needs every bundled backend installed; missing {missing} "
            "(bash scripts/setup.sh installs them into .venv)"
        )
    return out


def _type_name(annotation: Any) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return " | ".join(repr(a).replace("'", "") for a in typing.get_args(annotation))
    text = annotation.__name__ if isinstance(annotation, type) else str(annotation)
    text = re.sub(r"\b(typing|pathlib|collections\.abc)\.", "", text)
    text = text.replace("Literal[", "one of [")
    return text


def _default(value: Any) -> str:
    if value is None or value == "":
        return "–"
    if isinstance(value, bool):
        return "`1`" if value else "`0`"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def settings_table(tuning: bool = False) -> str:
    """The markdown table: one row per environment variable, in the models' order; the
    user's settings, or with ``tuning`` the knobs marked ``setting(..., tuning=True)``."""
    from meshcomm.runtime.config import env_names

    rows: dict[str, dict[str, Any]] = {}
    for section, model in settings_models():
        envs = env_names(model)
        for name, field in model.model_fields.items():
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            if name not in envs or bool(extra.get("tuning")) != tuning:
                continue
            var = envs[name]
            row = rows.setdefault(
                var,
                {
                    "used": [],
                    "default": _default(field.default),
                    "type": _type_name(field.annotation),
                    "description": field.description or "",
                    "accepts": str(extra.get("accepts", "")),
                },
            )
            row["used"].append(section)
    lines = [
        "| variable | default | type | used by | meaning (and what it accepts) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for var, row in rows.items():
        accepts = f" *Accepts:* {_cell(row['accepts'])}." if row["accepts"] else ""
        lines.append(
            f"| `{var}` | {row['default']} | {_cell(row['type'])} | {', '.join(row['used'])} "
            f"| {_cell(row['description']).rstrip('.')}.{accepts} |"
        )
    return "\n".join(lines)


def with_settings_table(markdown: str, tuning: bool = False) -> str:
    """``markdown`` (docs/settings.md, or with ``tuning`` docs/tuning.md) with the text between
    the table markers replaced by the current table."""
    begin, end = markdown.find(TABLE_BEGIN), markdown.find(TABLE_END)
    if begin < 0 or end < begin:
        raise ValueError(f"the page lacks the markers {TABLE_BEGIN!r} ... {TABLE_END!r}")
    return markdown[: begin + len(TABLE_BEGIN)] + "\n" + settings_table(tuning) + "\n" + markdown[end:]


def with_tuning_table(markdown: str) -> str:
    """docs/tuning.md with its table of the tuning knobs current."""
    return with_settings_table(markdown, tuning=True)


def variable_names() -> list[str]:
    """Every variable docs/settings.md documents (generated table included), in page order."""
    text = with_settings_table((DOCS / "settings.md").read_text())
    names: list[str] = []
    for name in re.findall(r"`((?:MLX|MESHCOMM)_[A-Z0-9_]+)`", text):
        if name not in names:
            names.append(name)
    return names


def with_variable_names(markdown: str) -> str:
    """``markdown`` (the README) with the list between the name markers replaced by the
    current names, wrapped at 90 columns."""
    begin, end = markdown.find(NAMES_BEGIN), markdown.find(NAMES_END)
    if begin < 0 or end < begin:
        raise ValueError(f"README.md lacks the markers {NAMES_BEGIN!r} ... {NAMES_END!r}")
    words = [f"`{n}`," for n in variable_names()]
    words[-1] = words[-1].rstrip(",") + "."
    lines, line = [], ""
    for w in words:
        if line and len(line) + 1 + len(w) > 90:
            lines.append(line)
            line = w
        else:
            line = f"{line} {w}" if line else w
    lines.append(line)
    return markdown[: begin + len(NAMES_BEGIN)] + "\n" + "\n".join(lines) + "\n" + markdown[end:]


# -- links ----------------------------------------------------------------------------------
def _targets(markdown: str) -> list[tuple[int, int, str]]:
    """(start, end, target) of every relative link outside fenced code blocks."""
    out = []
    pos, fenced = 0, False
    for line in markdown.splitlines(keepends=True):
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            for m in _LINK.finditer(line):
                target = m.group(2)
                if "://" not in target and not target.startswith(("#", "mailto:")):
                    out.append((pos + m.start(2), pos + m.end(2), target))
        pos += len(line)
    return out


def rewrite_links(markdown: str, real: Path, virtual_dir: str) -> tuple[str, list[str]]:
    """Links of the file at ``real`` rewritten for a page that lives at ``virtual_dir`` (a
    folder inside docs/): targets inside docs/ become relative to it, other files of the
    repository point to their copy under ``_repo/``. Returns the text and the repository
    paths (relative to the root) that need a copy."""
    copies: list[str] = []
    pieces, last = [], 0
    for start, end, target in _targets(markdown):
        path, _, anchor = target.partition("#")
        if not path:
            continue
        dest = (real.parent / path).resolve()
        if not dest.is_relative_to(ROOT) or not dest.exists():
            continue  # left as it is: mkdocs reports it
        if dest.is_relative_to(DOCS):
            rel = dest.relative_to(DOCS).as_posix()
        else:
            rel = _REPO_PREFIX + dest.relative_to(ROOT).as_posix()
            copies.append(dest.relative_to(ROOT).as_posix())
        depth = len([p for p in virtual_dir.split("/") if p not in ("", ".")])
        new = "../" * depth + rel + (f"#{anchor}" if anchor else "")
        pieces.append(markdown[last:start] + new)
        last = end
    pieces.append(markdown[last:])
    return "".join(pieces), copies


def _real_path(src_uri: str) -> Path:
    return ROOT / "README.md" if src_uri == "index.md" else DOCS / src_uri


# -- mkdocs hooks -------------------------------------------------------------------------
def _nav_paths(nav: Any) -> set[str]:
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, dict):
        return set().union(*(_nav_paths(v) for v in nav.values())) if nav else set()
    if isinstance(nav, list):
        return set().union(*(_nav_paths(v) for v in nav)) if nav else set()
    return set()


def on_config(config: Any) -> Any:
    """A page of docs/ that mkdocs.yml's nav does not list yet is appended to it under its
    own title (e.g. a page another change adds), so that it is reachable and the strict
    build does not depend on two files being edited together."""
    if not config.nav:
        return config
    listed = _nav_paths(config.nav)
    for page in sorted(DOCS.rglob("*.md")):
        rel = page.relative_to(DOCS).as_posix()
        if rel not in listed:
            title = next(
                (ln[2:].strip().strip("`") for ln in page.read_text().splitlines() if ln.startswith("# ")), page.stem
            )
            config.nav.append({title: rel})
    return config


def on_files(files: Any, config: Any) -> Any:
    """Add the README as index.md and every repository file the pages link to."""
    from mkdocs.structure.files import File

    if files.get_file_from_path("index.md") is None:
        files.append(File.generated(config, "index.md", content=(ROOT / "README.md").read_text()))
    wanted: set[str] = set()
    for f in list(files.documentation_pages()):
        real = _real_path(f.src_uri)
        if real.exists():
            _, copies = rewrite_links(real.read_text(), real, str(Path(f.src_uri).parent))
            wanted.update(copies)
    for rel in sorted(wanted):
        if files.get_file_from_path(_REPO_PREFIX + rel) is None:
            files.append(File.generated(config, _REPO_PREFIX + rel, abs_src_path=str(ROOT / rel)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Rewrite links for the site; render the settings table into settings.md."""
    src_uri = page.file.src_uri
    if src_uri == "settings.md":
        markdown = with_settings_table(markdown)
    elif src_uri == "tuning.md":
        markdown = with_tuning_table(markdown)
    elif src_uri == "index.md" and NAMES_BEGIN in markdown:
        markdown = with_variable_names(markdown)
    text, _ = rewrite_links(markdown, _real_path(src_uri), str(Path(src_uri).parent))
    return text


_ROLE = re.compile(r":(?:func|class|data|mod|meth|attr|exc|obj):(<code>)")


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    """Docstrings use Sphinx roles (``:func:`name```); the reference shows just the name."""
    return _ROLE.sub(r"\1", html)


def main(argv: list[str] | None = None) -> int:
    """``--write``: render the settings tables into docs/settings.md and docs/tuning.md and
    the variable names into README.md; ``--check``: exit 1 if any is stale."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="write the tables into docs/settings.md and docs/tuning.md")
    ap.add_argument("--check", action="store_true", help="exit 1 when a generated part is out of date")
    args = ap.parse_args(argv)
    stale = 0
    pages = (
        (DOCS / "settings.md", with_settings_table),
        (DOCS / "tuning.md", with_tuning_table),
        (ROOT / "README.md", with_variable_names),
    )
    for path, render in pages:
        old = path.read_text()
        new = render(old)
        if args.write and new != old:
            path.write_text(new)
            print(f"wrote {path}")
        if args.check and new != old:
            print(f"{path} is out of date: run python scripts/docs_hooks.py --write", file=sys.stderr)
            stale = 1
    if stale:
        return 1
    if not (args.write or args.check):
        print(settings_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
