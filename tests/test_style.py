"""Style (docs/STYLE.md point 10): no line of the repository's Python files is longer than black's
line length in pyproject.toml. Black wraps code only; this also holds comments, docstrings and
strings to it. Reads files, runs nothing: milliseconds."""

import ast
import glob
import os
import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the trainer's modules, the benchmarks, the tests, the examples and the CPU stand-in for sgl_kernel
PATTERNS = [
    "*.py",
    "runtime/*.py",
    "task/*.py",
    "extras/*.py",
    "bench/*.py",
    "tests/*.py",
    "examples/**/*.py",
    "cpu_compat/**/*.py",
]


def python_files():
    found = set()
    for pattern in PATTERNS:
        found.update(glob.glob(os.path.join(REPO, pattern), recursive=True))
    return sorted(found)


def test_no_line_is_longer_than_the_configured_line_length():
    """Every line of every .py file at the top level and under bench/, tests/, examples/ and
    cpu_compat/ fits in pyproject.toml's line length; a failure lists each file:line."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        limit = tomllib.load(f)["tool"]["black"]["line-length"]
    paths = python_files()
    # the patterns still find the code
    assert os.path.join(REPO, "train.py") in paths and os.path.abspath(__file__) in paths
    too_long = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                length = len(line.rstrip("\r\n"))
                if length > limit:
                    too_long.append(f"{os.path.relpath(path, REPO)}:{number}: {length} characters")
    assert not too_long, f"{len(too_long)} lines over {limit} characters:\n" + "\n".join(too_long)


def test_every_dotted_name_in_the_readme_exists():
    """Each `name.attribute` the README shows in backticks is a module's attribute (the top level
    or runtime/, task/, extras/: `engine.request`), a class's method, a config key
    (`section.field`), or a file: the reading order cannot point at code that moved, and a
    misspelt key is caught (`model.lora_rnak`)."""
    import ast
    import dataclasses
    import re

    import config

    paths = [
        p
        for folder in ("", "runtime", "task", "extras")
        for p in glob.glob(os.path.join(REPO, folder, "*.py"))
    ]
    names = {}  # module or class -> its top-level (or method) names, read without importing
    for path in paths:
        module = os.path.basename(path)[:-3]
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        names.setdefault(module, set())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names[module].add(node.name)
            if isinstance(node, ast.ClassDef):
                names[node.name] = {n.name for n in ast.walk(node) if hasattr(n, "name")}
                names[node.name] |= {t.target.id for t in node.body if isinstance(t, ast.AnnAssign)}
            for target in getattr(node, "targets", []):
                names[module].add(getattr(target, "id", None))
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names[module] |= {a.asname or a.name for a in node.names}
    sections = {f.name: f.type for f in dataclasses.fields(config.Config)}
    keys = {
        f"{section}.{field.name}"
        for section, kind in sections.items()
        for field in dataclasses.fields(kind)
    }
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    missing = []
    for code in re.findall(r"`([^`\n]+)`", readme):
        for first, second in re.findall(r"\b([A-Za-z_]\w*)\.([A-Za-z_]\w*)\b", code):
            if first in ("py", "yaml", "md", "png", "jsonl") or second in ("py", "yaml", "md"):
                continue
            known = second in names.get(first, ()) or f"{first}.{second}" in keys
            if (first in names or first in sections) and not known:
                missing.append(f"{first}.{second}")
    assert not missing, f"README names that do not exist: {sorted(set(missing))}"


def test_the_substrate_imports_no_stage():
    """runtime/ (engine, model, parallel, checkpoint, estimate) is what the stages run on: its
    modules import no module of this repository but each other and config.py; the assembly that
    imports the stages (assemble.py) sits above them, beside train.py."""
    local = {os.path.splitext(name)[0] for name in os.listdir(REPO) if name.endswith(".py")} | {
        "task",
        "extras",
        "runtime",
    }
    found = {}
    for name in sorted(os.listdir(os.path.join(REPO, "runtime"))):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(REPO, "runtime", name), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            modules = []
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules = [node.module]
            for module in modules:
                top = module.split(".")[0]
                if top in local and top not in ("runtime", "config"):
                    found.setdefault(name, []).append(module)
    assert not found, f"runtime/ imports stage modules: {found}"


def test_no_statement_follows_a_return_or_raise_in_its_block():
    """Code after a return, raise, continue or break in the same block never runs. A function
    pasted into another's body by an edit once made a check's last four refusals dead code, which
    only two tests elsewhere noticed."""
    found = []
    for path in python_files():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            for field in ("body", "orelse", "finalbody"):
                block = getattr(node, field, None)
                if not isinstance(block, list):
                    continue
                for ended, after in zip(block, block[1:]):
                    if isinstance(ended, (ast.Return, ast.Raise, ast.Continue, ast.Break)):
                        found.append(f"{os.path.relpath(path, REPO)}:{after.lineno}")
    assert not found, f"unreachable statements: {found}"
