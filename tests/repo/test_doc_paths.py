"""Every path named in a comment, a docstring or a doc exists: a file moved or removed leaves no
stale name behind. Paths are read the way a reader would follow them: from the repository
root, from jspec/ (`worker/base.py`), or from the folder of the file that names them
(`support/precision.py` in tests/); a bare file name (`moe.py`, `NOTES.md`) must name a file
somewhere in the repository."""

import ast
import io
import os
import re
import tokenize

from support import REPO_ROOT

# Where the names are read: jspec's and the tests', benchmarks' and scripts' comments and
# docstrings, and the docs. benchmarks/NOTES.md is a journal: it names files as they were.
SOURCES = ("jspec", "tests", "benchmarks", "scripts")
DOCS = ("README.md", "docs")
TOP_FOLDERS = ("jspec", "tests", "benchmarks", "docs", "scripts")
# Other projects' files, named as in their own repositories.
FOREIGN = ("python/sglang/", "eagle/model/")
SKIPPED_FOLDERS = {"__pycache__", "results", "shapes"}

# A path: folders then a .py / .md / .sh file, or a folder under one of the top folders
# (`tests/engine/`), or one of jspec's packages (`worker/`).
FILE = r"(?:[\w.-]+/)*[\w-]+\.(?:py|md|sh)\b"
FOLDER = r"(?:[\w-]+/)+"
PATH = re.compile(rf"(?<![\w./-])({FILE}|{FOLDER})(?![\w-])")


def repo_files() -> list[str]:
    out = []
    for folder, dirs, files in os.walk(REPO_ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIPPED_FOLDERS]
        out += [os.path.join(folder, f) for f in files]
    return out


def named_texts(path: str) -> list[tuple[int, str]]:
    """(line, text) of a Python file's comments and docstrings, or of every line of a doc."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    if not path.endswith(".py"):
        return list(enumerate(source.splitlines(), 1))
    out = [
        (t.start[0], t.string)
        for t in tokenize.generate_tokens(io.StringIO(source).readline)
        if t.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append((node.body[0].lineno, doc))
    return out


def named_paths(text: str, packages: set[str]) -> list[str]:
    paths = []
    for match in PATH.finditer(text):
        path = match.group(1)
        if path.startswith(FOREIGN):
            continue
        if path.endswith("/") and path.split("/")[0] not in TOP_FOLDERS + tuple(packages):
            continue  # q/k/, 1/2/: slashes that are no folders
        paths.append(path)
    return paths


def resolves(path: str, named_in: str, file_names: set[str]) -> bool:
    if "/" not in path.rstrip("/") and path in file_names:
        return True
    bases = [REPO_ROOT, os.path.join(REPO_ROOT, "jspec")]
    folder = os.path.dirname(named_in)
    while len(folder) >= len(REPO_ROOT):
        bases.append(folder)
        folder = os.path.dirname(folder)
    return any(os.path.exists(os.path.join(base, path)) for base in bases)


def test_every_path_named_in_comments_and_docs_exists():
    files = repo_files()
    file_names = {os.path.basename(f) for f in files}
    jspec = os.path.join(REPO_ROOT, "jspec")
    packages = {d for d in os.listdir(jspec) if os.path.isfile(os.path.join(jspec, d, "__init__.py"))}
    roots = [os.path.join(REPO_ROOT, s) + os.sep for s in SOURCES + DOCS]
    readers = [
        f
        for f in files
        if (f.endswith(".py") or (f.endswith(".md") and not f.endswith("NOTES.md")))
        and (any(f.startswith(r) for r in roots) or f == os.path.join(REPO_ROOT, "README.md"))
    ]
    assert len(readers) > 100
    stale = [
        f"{os.path.relpath(f, REPO_ROOT)}:{line}: {path}"
        for f in readers
        for line, text in named_texts(f)
        for path in named_paths(text, packages)
        if not resolves(path, f, file_names)
    ]
    assert stale == [], "paths that do not exist:\n" + "\n".join(stale)


def test_the_reader_finds_stale_paths_and_passes_real_ones():
    files = repo_files()
    file_names = {os.path.basename(f) for f in files}
    here = os.path.join(REPO_ROOT, "tests", "unit", "test_doc_paths.py")
    text = "see worker/base.py, support/precision.py, tests/engine/, NOTES.md, q/k/v and spec/eagle.py"
    found = named_paths(text, {"worker"})
    assert found == ["worker/base.py", "support/precision.py", "tests/engine/", "NOTES.md", "spec/eagle.py"]
    assert [p for p in found if not resolves(p, here, file_names)] == ["spec/eagle.py"]
    assert not resolves("DESIGN.md", here, file_names)
