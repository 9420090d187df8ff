"""WORKSPACE.md stays a true map: every repository path and every project module it names exists.

What counts as a name, read from the text alone (nothing is imported, so this runs in well under a second):
- a word inside `backticks`, or any word of the fenced Layout block, that has a "/" or ends in .py / .md / .txt /
  .toml is a path. It resolves against the repository root or any folder under the code's roots (so `train/loop.py`
  finds mercury_jax/train/loop.py and a bare `loop.py` finds any loop.py); `<...>`, `*`, `{a,b}` and the placeholder
  words `X`, `NAME` must match at least one file. A `path:attr` also needs `attr` defined in one such file.
- a dotted name starting with a project package (`mercury_jax.train.sao`, `mercury_jax.bench.{pod,gae}`) resolves to
  a module file, with at most one trailing part that the module defines.
Paths inside a run directory (`WORKDIR/...`, `STAGE/...`) and URIs are not repository paths and are skipped.
"""
from __future__ import annotations

import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKSPACE = ROOT / "WORKSPACE.md"
CODE_ROOTS = ("mercury_jax", "models", "mercury_kernels", "tests", "docs", "tools", "experiments", ".ci")
PACKAGES = ("mercury_jax", "models", "mercury_kernels", "experiments", "tests", "tools")
SUFFIXES = (".py", ".md", ".txt", ".toml")
PLACEHOLDERS = ("X", "NAME")
USER_PATH_FLAGS = ("--workdir", "--out", "--data")  # their values are the user's paths, not the repository's
NOT_PATHS = {"tools/list": "an MCP method, not the repository's tools/ folder"}
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE = re.compile(r"`([^`]+)`")
DOTTED = re.compile(r"^(" + "|".join(PACKAGES) + r")(\.(\w+|\{[\w,]+\}))+$")


def _line_of(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def _words() -> list[tuple[int, str]]:
    """(line, word) for every word in backticks outside the fenced blocks and every word inside them, less the
    values of `USER_PATH_FLAGS`."""
    text = WORKSPACE.read_text()
    words = []
    for block in FENCE.finditer(text):
        first = _line_of(text, block.start())
        for offset, line in enumerate(block.group(0).splitlines()[1:-1], start=1):
            words += [(first + offset, word) for word in line.replace("`", " ").split()]
    outside = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for span in INLINE.finditer(outside):
        start = _line_of(outside, span.start())
        words += [(start + span.group(1).count("\n", 0, m.start()), m.group(0))
                  for m in re.finditer(r"\S+", span.group(1))]
    return [(line, word) for (line, word), (_, before) in zip(words, [(0, "")] + words[:-1])
            if before not in USER_PATH_FLAGS]


def _clean(word: str) -> str:
    """The word without the punctuation of the sentence around it."""
    word = word.strip("\"'")
    while word and word[0] in "([,;:":
        word = word[1:]
    while word and word[-1] in ")],;:.!?":
        word = word[:-1]
    return word


def _expand_braces(name: str) -> list[str]:
    """`a.{b,c}` -> [`a.b`, `a.c`] (every brace group, in order)."""
    parts = re.split(r"(\{[^{}]*\})", name)
    choices = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
    return ["".join(c) for c in itertools.product(*choices)]


def _bases() -> list[Path]:
    """The folders a relative path may be written against: the root and every folder under the code's roots."""
    bases = [ROOT]
    for top in CODE_ROOTS:
        bases += [p for p in [ROOT / top, *(ROOT / top).rglob("*")] if p.is_dir() and "__pycache__" not in p.parts]
    return bases


def _glob_pattern(path: str) -> str:
    """`path` with `<...>` and the placeholder words as `*`: `config/NAME_rules.py` -> `config/*_rules.py`."""
    path = re.sub(r"<[^<>]*>", "*", path)
    return re.sub(r"(?<![A-Za-z])(" + "|".join(PLACEHOLDERS) + r")(?![A-Za-z])", "*", path)


def _matches(path: str, bases: list[Path]) -> list[Path]:
    """The files or folders `path` names under any of `bases` (every one of its `{a,b}` choices must name one)."""
    found = []
    for variant in _expand_braces(_glob_pattern(path.rstrip("/"))):
        hits = [p for base in bases for p in (base.glob(variant) if "*" in variant else [base / variant]) if p.exists()]
        if not hits:
            return []
        found += hits
    return found


def _defines(files: list[Path], name: str) -> bool:
    """Whether one of `files` defines or imports `name` at the start of a line (def, class, assignment, import)."""
    pattern = re.compile(rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b|^\s*{name}\s*[:=]|^(?:from|import)\b.*\b{name}\b",
                         re.M)
    return any(f.is_file() and f.suffix == ".py" and pattern.search(f.read_text()) for f in files)


def _path_problem(word: str, bases: list[Path]) -> str | None:
    """Why `word` (a cleaned path-like word, maybe `path:attr`) names nothing in the repository, or None."""
    path, _, rest = re.split(r"[\[(]", word)[0].partition(":")
    if path in NOT_PATHS or re.match(r"^[A-Z_]+/", path):
        return None
    files = _matches(path, bases)
    if not files:
        return f"{path} is not in the repository"
    attr = re.match(r"\w*", rest).group(0)
    if attr and not _defines(files, attr):
        return f"{path} defines no {attr}"
    return None


def _module_problem(name: str) -> str | None:
    """Why the dotted `name` is no module of the repository (plus at most one name the module defines), or None."""
    for variant in _expand_braces(name):
        parts = variant.split(".")
        for cut in range(len(parts), 0, -1):
            stem = ROOT.joinpath(*parts[:cut])
            module = stem.with_suffix(".py") if stem.with_suffix(".py").is_file() else stem / "__init__.py"
            if module.is_file():
                break
        else:
            return f"{variant}: no module {parts[0]}"
        rest = parts[cut:]
        if len(rest) > 1 or (rest and not _defines([module], rest[0])):
            return f"{variant}: {module.relative_to(ROOT)} has no {'.'.join(rest)}"
    return None


def _is_path(word: str) -> bool:
    path = re.split(r"[\[(:]", word)[0] if "://" not in word else ""
    return bool(path) and ("/" in path or path.endswith(SUFFIXES))


def test_every_path_and_module_workspace_names_exists():
    bases = _bases()
    problems = []
    for line, raw in _words():
        word = _clean(raw)
        if "://" in word:
            continue
        if _is_path(word):
            problem = _path_problem(word, bases)
        elif DOTTED.match(word):
            problem = _module_problem(word)
        else:
            continue
        if problem:
            problems.append(f"WORKSPACE.md:{line}: {raw!r}: {problem}")
    assert not problems, "WORKSPACE.md names what does not exist:\n" + "\n".join(problems)


def test_the_map_reads_its_names():
    """The reader above sees the map's names (a change to the extraction that finds nothing would pass vacuously)."""
    words = {_clean(word) for _, word in _words()}
    assert {"mercury_jax/train/", "mercury_jax/rl/advantages.py:skip_observation_gae", "mercury_jax.main"} <= words
