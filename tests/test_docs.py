"""The user docs name only what exists: every repository path, module and `workbench` command that README.md and
docs/*.md mention is checked against the checkout and the CLI's registered commands.

Checked:
- paths under the repository's top-level folders (`workbench/...py`, `models/...`, `docs/...md`, ...): the file or
  folder exists. Not checked: templates and globs (`<name>`, `*`, `{a,b}`), paths inside another project's
  repository (written `project:path`, or part of a URL), paths under `~/`, `/tmp`, `.cache/`, and the output folders
  .gitignore lists from the root (results/, reports/, paper/figures/, ...), which a command writes.
- modules: `python -m X` for X in this repository resolves to a .py file or a package; a dotted reference
  (`workbench.roofline.prediction.kernel_time`) resolves to a module, and the first name after the module is
  defined in it (a def, a class, an assignment or an import).
- commands: `workbench X [Y]` inside code (inline or fenced) names a registered command, and a registered
  sub-command where X is a group.

No JAX program is compiled: the CLI's command table comes from its typer app.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP = ("workbench", "models", "partitioning", "benchmarks", "tests", "docs", "notebooks", "paper")
PACKAGES = ("workbench", "models", "partitioning", "benchmarks", "tests", "notebooks")

# a repository path: one of the top-level folders, not inside a longer path, a URL, `project:path` or ~/
PATH_RE = re.compile(r"(?<![\w./~:@-])((?:%s)/[\w./<>*{}-]*)" % "|".join(TOP))
# a dotted module reference: workbench.roofline.prediction, models.quant.matmul_format, ...
MODULE_RE = re.compile(r"(?<![\w./:-])((?:%s)(?:\.[A-Za-z_]\w*)+)" % "|".join(PACKAGES))
PYTHON_M_RE = re.compile(r"\bpython3?\s+-m\s+([A-Za-z_][\w.]*)")
FENCE_RE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
SPAN_RE = re.compile(r"`((?:[^`\n]|\n(?![ \t]*\n))+)`")  # inline code, across line breaks within a paragraph
INDENTED_RE = re.compile(r"(?:^(?: {4}|\t).*\n?)+", re.M)  # indented code blocks
CMD_RE = re.compile(r"(?:^|[\s(|;&$])workbench\s+([a-z][\w-]*)(?:[ \t]+([a-z][\w-]*))?")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@functools.lru_cache(maxsize=1)
def output_dirs() -> tuple[str, ...]:
    """Folders a command writes into (not tracked): .cache/ and the root-anchored folders in .gitignore."""
    out = [".cache/"]
    gi = ROOT / ".gitignore"
    for line in gi.read_text().splitlines() if gi.exists() else ():
        line = line.strip()
        if line.startswith("/") and line.endswith("/") and not any(c in line for c in "*?["):
            out.append(line[1:])
    return tuple(out)


def code_chunks(text: str) -> list[str]:
    """The fenced and indented code blocks and the inline code spans of a Markdown text; comments in blocks dropped."""
    blocks = [m.group(0) for m in FENCE_RE.finditer(text)]
    rest = FENCE_RE.sub("", text)
    blocks += [m.group(0) for m in INDENTED_RE.finditer(rest)]
    blocks = [re.sub(r"(?m)(^|\s)#.*$", "", b) for b in blocks]
    return blocks + [m.group(1) for m in SPAN_RE.finditer(INDENTED_RE.sub("", rest))]


def path_problems(text: str) -> set[str]:
    bad = set()
    for m in PATH_RE.finditer(text):
        p = m.group(1).rstrip(".,:;)")
        if any(c in p for c in "<>*{}") or "..." in p:
            continue  # a template or a glob
        if p.startswith(output_dirs()):
            continue
        if not (ROOT / p.rstrip("/")).exists():
            bad.add(p)
    return bad


def _module_path(parts: list[str]) -> tuple[Path | None, list[str]]:
    """(the source of the longest module prefix of `parts`, the names after it); None when not even the top is one."""
    cur = ROOT / parts[0]
    if not (cur / "__init__.py").exists():
        return None, parts
    src = cur / "__init__.py"
    for i, name in enumerate(parts[1:], start=1):
        if (cur / name / "__init__.py").exists():
            cur = cur / name
            src = cur / "__init__.py"
        elif (cur / f"{name}.py").exists():
            return cur / f"{name}.py", parts[i + 1:]
        else:
            return src, parts[i:]
    return src, []


def _defines(src: Path, name: str) -> bool:
    n = re.escape(name)
    pattern = (rf"^\s*(?:async\s+)?def\s+{n}\b|^\s*class\s+{n}\b|^\s*{n}\s*(?::|=(?!=))|"
               rf"^\s*(?:from\s+\S+\s+)?import\s[^\n]*\b{n}\b|^\s+{n},|\(\s*{n}\s*[,)]")
    return re.search(pattern, src.read_text(), re.M) is not None


def module_problems(text: str) -> set[str]:
    bad = set()
    for m in MODULE_RE.finditer(PYTHON_M_RE.sub(" ", text)):
        ref = m.group(1)
        src, rest = _module_path(ref.split("."))
        if src is None or (rest and not _defines(src, rest[0])):
            bad.add(ref)
    for m in PYTHON_M_RE.finditer(text):
        mod = m.group(1).rstrip(".")
        parts = mod.split(".")
        if parts[0] not in PACKAGES:
            continue  # pytest, pip, ...: not this repository's
        src, rest = _module_path(parts)
        if src is None or rest:
            bad.add(f"python -m {mod}")
    return bad


@functools.lru_cache(maxsize=1)
def cli_commands() -> dict[str, set[str] | None]:
    """The typer app's commands: name -> its sub-commands' names (a group) or None (a command)."""
    import typer

    from workbench.cli import app

    out: dict[str, set[str] | None] = {}
    for name, cmd in typer.main.get_command(app).commands.items():
        subs = getattr(cmd, "commands", None)
        out[name] = set(subs) if subs else None
    return out


def command_problems(text: str) -> set[str]:
    bad = set()
    commands = cli_commands()
    for chunk in code_chunks(text):
        for m in CMD_RE.finditer(chunk):
            name, sub = m.group(1), m.group(2)
            if name not in commands:
                bad.add(f"workbench {name}")
            elif commands[name] is not None and sub and sub not in commands[name]:
                bad.add(f"workbench {name} {sub}")
    return bad


def test_docs_name_only_what_exists():
    problems = []
    for f in doc_files():
        text = f.read_text()
        rel = f.relative_to(ROOT)
        for kind, found in (("path", path_problems(text)), ("module", module_problems(text)),
                            ("command", command_problems(text))):
            problems += [f"{rel}: {kind} {x}" for x in sorted(found)]
    assert not problems, "the docs name what does not exist:\n" + "\n".join(problems)


def test_the_checks_catch_what_they_should():
    assert path_problems("see `workbench/train.py` and workbench/programs/train.py") == {"workbench/train.py"}
    assert path_problems("`results/x.json`, `notebooks/*.py`, ~/.cache/workbench, maxtext:docs/x.md") == set()
    assert module_problems("`workbench.roofline.prediction.kernel_time`, python -m benchmarks.prediction_error, "
                           "python -m pytest") == set()
    assert module_problems("workbench.calibrate.get_spec; python -m benchmarks.nothing_here") == {
        "workbench.calibrate.get_spec", "python -m benchmarks.nothing_here"}
    assert command_problems("`workbench run --steps 2`, `workbench hw list`") == set()
    assert command_problems("`workbench train`, `workbench hw frobnicate`") == {"workbench train",
                                                                                "workbench hw frobnicate"}
