"""What the docs and the code's own words cite, and whether each citation still resolves (tests/test_citations.py).

Read: docs/*.md and README.md whole, the comments and docstrings of runner/, policy/, vmimages/, action/
and microvm_check/, and the comments of the YAML files the project ships or tests with (YAML_FOLDERS). A
citation is one of:
- a repository path: a token of folders and a file with a known suffix (`runner/service/jobs/job.py`), whose
  first folder is one of the repository's top-level ones; it resolves when the file (or folder) exists. A path
  written from inside a package (`jobs/job.py` in runner/service/) resolves against the folder the text is in
  or one above it, up to the root. A line (`engine.py:88`, `:88-94`) must exist in that file;
- a bare file name (`job.py`): in the code, a file of that name in the citing file's folder or one above it
  (the wing or package the text is in), or directly in a folder below one of those; in the docs, a file of
  that name anywhere under the repository's code (so a name that no longer exists anywhere is caught);
- a dotted name beginning with a package of the project (`runner.service.jobs.job.AdmittedSpec`,
  `policy.suggest.admitted`, `microvm_check.entries`): the longest module prefix imports, and each name after
  it is an attribute (a module, a class, a function, a class's member);
- `Class.member` with `Class` a class defined in the project (`Engine.create`, `JobRun.template`): some class
  of that name has that member (a method, property, class attribute or annotated field). A class name the
  project does not define (`Path.open`) is not a citation.
Not citations: absolute paths (`/run/...`, a guest's paths), URLs, `~/` paths, globs, and a token whose first
folder is not the repository's (a path inside a VM, an example's own tree).
"""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODE = ("runner", "policy", "vmimages", "action", "microvm_check")
PACKAGES = CODE
YAML_FOLDERS = ("examples", "contrib", "tests/fixtures")
SUFFIXES = ("py", "md", "toml", "json", "yml", "yaml", "sh", "html", "txt", "cfg", "ini", "lock")

_SUFFIX = "|".join(SUFFIXES)
# A path: folders and a file with a known suffix (or a folder ending in /), an optional :line or :line-line.
PATH = re.compile(
    rf"(?<![\w./~$%{{*-])((?:[A-Za-z0-9_][\w.-]*/)*[A-Za-z0-9_][\w-]*(?:\.[\w-]+)*\.(?:{_SUFFIX}))"
    rf"(?::(\d+)(?:-(\d+))?)?(?![\w/*{{])"
)
DOTTED = re.compile(rf"(?<![\w./-])((?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_]\w*)+)(?![\w(/-])")
MEMBER = re.compile(r"(?<![\w./-])([A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*)\.([a-z_]\w*)(?![\w/*<-])")


# Bare file names that are not the project's, each where it is written: what a fork's checkout may hold
# (README, runner/fleet/hook.py), a command in an example (README, runner/service/jobs/command.py), the
# verifier docs/attestation.md has the reader write.
NOT_OURS = frozenset({"setup.py", "conftest.py", "sitecustomize.py", "check.py", "run_tests.py", "verify_record.py"})
# Dotted names that are not modules: a logger's name (runner/logs.py).
NOT_MODULES = frozenset({"runner.jobs"})
# Class.member written about another project's class of the same name: in-toto's Envelope (docs/attestation.md).
NOT_MEMBERS = frozenset({"Envelope.from_dict"})


@dataclass(frozen=True)
class Citation:
    source: str  # the citing file, repository-relative
    line: int  # where it is cited
    text: str  # as written

    def __str__(self) -> str:
        return f"{self.source}:{self.line}: {self.text}"


def texts() -> Iterator[tuple[Path, int, str]]:
    """Each piece of prose to read: (file, first line, text)."""
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        yield doc, 1, doc.read_text()
    for package in CODE:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "__pycache__" not in path.parts:
                yield from prose(path, path.read_text())
    for folder in YAML_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.y*ml")):
            yield from yaml_comments(path, path.read_text())


def yaml_comments(path: Path, source: str) -> Iterator[tuple[Path, int, str]]:
    """A YAML file's comments: each line's text after a `#` that begins a comment (at the line's start or
    after a blank), which is all that may cite the project (its values are a config's, not prose)."""
    for number, line in enumerate(source.splitlines(), start=1):
        found = re.search(r"(?:^|\s)#(.*)", line)
        if found:
            yield path, number, found.group(1)


def prose(path: Path, source: str) -> Iterator[tuple[Path, int, str]]:
    """A Python file's comments and docstrings."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield path, token.start[0], token.string
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                yield path, first.lineno, first.value.value


def citations(path: Path, first: int, text: str) -> Iterator[tuple[Citation, str]]:
    """Each citation in a text, with its kind ("path", "dotted", "member")."""
    source = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.as_posix()
    for number, line in enumerate(text.splitlines(), start=first):
        if "://" in line:
            line = re.sub(r"\w+://\S+", " ", line)
        for match in PATH.finditer(line):
            yield Citation(source, number, match[0]), "path"
        for match in DOTTED.finditer(line):
            if match[1].rsplit(".", 1)[1] in SUFFIXES:
                continue  # a file's name (`action.yml`), read as a path
            yield Citation(source, number, match[1]), "dotted"
        for match in MEMBER.finditer(line):
            yield Citation(source, number, match[0]), "member"


def problem(citation: Citation, kind: str) -> str | None:
    """Why a citation does not resolve, or None when it does (or is not the project's)."""
    if kind == "path":
        return _path_problem(citation)
    if kind == "dotted":
        return _dotted_problem(citation.text)
    return _member_problem(citation.text)


def _path_problem(citation: Citation) -> str | None:
    match = PATH.fullmatch(citation.text)
    assert match
    name, start, end = match[1], match[2], match[3]
    found = _resolve(citation.source, name)
    if found is _FOREIGN:
        return None
    if found is None:
        return "no such file"
    if start and found.is_file():
        count = len(found.read_text(errors="replace").splitlines())
        last = int(end or start)
        if not 1 <= int(start) <= last <= count:
            return f"{found.relative_to(ROOT).as_posix()} has {count} lines"
    return None


_FOREIGN = Path("/nonexistent-foreign")


def _resolve(source: str, name: str) -> Path | None:
    """The file a path names, None when it names none, _FOREIGN when it is not the repository's."""
    citing = (ROOT / source).parent
    folders = [citing, *[p for p in citing.parents if p.is_relative_to(ROOT)]]
    if "/" in name:
        head = name.split("/", 1)[0]
        if (ROOT / head).is_dir() and head not in (".", ".."):
            return ROOT / name if (ROOT / name).exists() else None
        for folder in folders:
            if (folder / name).exists():
                return folder / name
        if head in _package_folders():
            return None  # runner's own folder name, cited from elsewhere (`service/jobs/x.py`): must resolve
        return _FOREIGN
    if name in NOT_OURS or not name.endswith((".py", ".md")):
        return _FOREIGN  # a name in an example, or a file a bare name would not find (`log.txt`, `_org.yml`)
    if source.endswith(".md"):
        named = _files_named().get(name)
        if named:
            return named[0]
        return (ROOT / name) if (ROOT / name).exists() else None
    for folder in folders:
        if (folder / name).exists():
            return folder / name
        for child in folder.iterdir() if folder.is_dir() and folder != ROOT else ():
            if child.is_dir() and (child / name).exists():
                return child / name
    return None


@cache
def _files_named() -> dict[str, list[Path]]:
    named: dict[str, list[Path]] = {}
    for top in (*CODE, "tests", "bench", "scripts", "docs", "examples", "contrib"):
        for path in sorted((ROOT / top).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                named.setdefault(path.name, []).append(path)
    return named


@cache
def _package_folders() -> frozenset[str]:
    return frozenset(p.name for top in CODE for p in (ROOT / top).rglob("*")
                     if p.is_dir() and "__pycache__" not in p.parts)


def _dotted_problem(text: str) -> str | None:
    if text in NOT_MODULES:
        return None
    parts = text.split(".")
    module = None
    for cut in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        break
    if module is None:
        return "no such module"
    value: object = module
    for name in parts[cut:]:
        if not hasattr(value, name) and not _annotated(value, name):
            return f"{'.'.join(parts[:parts.index(name)])} has no {name}"
        value = getattr(value, name, None)
    return None


def _annotated(value: object, name: str) -> bool:
    return isinstance(value, type) and any(name in getattr(k, "__annotations__", {}) for k in value.__mro__)


def _member_problem(text: str) -> str | None:
    if text in NOT_MEMBERS:
        return None
    cls, member = text.split(".")
    members = _classes().get(cls)
    if members is None:
        return None  # not a class of the project
    return None if member in members else f"no class {cls} has {member}"


@cache
def _classes() -> dict[str, set[str]]:
    """Each class name defined in the project's code, with every member any class of that name has."""
    classes: dict[str, set[str]] = {}
    for package in CODE:
        for path in (ROOT / package).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    classes.setdefault(node.name, set()).update(_members(node))
    bases: dict[str, set[str]] = {}
    for package in CODE:
        for path in (ROOT / package).rglob("*.py"):
            if "__pycache__" not in path.parts:
                for node in ast.walk(ast.parse(path.read_text())):
                    if isinstance(node, ast.ClassDef):
                        bases.setdefault(node.name, set()).update(
                            b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                            for b in node.bases)
    for _ in range(5):  # a member inherited from a project class counts
        for name, parents in bases.items():
            for parent in parents:
                classes[name] |= classes.get(parent, set())
                if parent in ("NamedTuple", "Enum", "IntEnum", "StrEnum", "Exception", "RuntimeError",
                              "ValueError", "OSError", "Thread", "BaseHTTPRequestHandler", "tuple", "str"):
                    classes[name].add("*")
    return classes


def _members(node: ast.ClassDef) -> Iterator[str]:
    for item in ast.walk(node):
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield item.name
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, (ast.Name, ast.Attribute)):
            yield item.target.id if isinstance(item.target, ast.Name) else item.target.attr
        elif isinstance(item, ast.Assign):
            for target in item.targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        yield leaf.id
                    elif isinstance(leaf, ast.Attribute):
                        yield leaf.attr


def broken(sources: Iterable[tuple[Path, int, str]]) -> tuple[int, list[str]]:
    """How many citations the texts hold, and each one that does not resolve, with why."""
    count, bad = 0, []
    for path, first, text in sources:
        for citation, kind in citations(path, first, text):
            count += 1
            why = problem(citation, kind)
            if why:
                bad.append(f"{citation} ({why})")
    return count, bad
