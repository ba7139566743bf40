"""Style (STYLE.md point 10): no line of the repository's Python files is longer than black's line
length in pyproject.toml. Black wraps code only; this also holds comments, docstrings and strings
to it. Reads files, runs nothing: milliseconds."""

import glob
import os
import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the trainer's modules, the benchmarks, the tests, the examples and the CPU stand-in for sgl_kernel
PATTERNS = ["*.py", "bench/*.py", "tests/*.py", "examples/**/*.py", "cpu_compat/**/*.py"]


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
