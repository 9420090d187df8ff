"""Write a benchmark's markdown table into its own section of BENCHMARKS.md.

Each benchmark owns one section delimited by `<!-- begin:NAME -->` / `<!-- end:NAME -->`; rewriting a section
leaves the others untouched, so several benchmarks can keep their tables in one file.
"""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import jax

BENCHMARKS_PATH = Path(__file__).resolve().parents[2] / "BENCHMARKS.md"
_HEADER = ("# Benchmarks\n\nEvery table below was printed by the command named under it; rerun it to refresh its "
           "section.\n")


def machine_description() -> str:
    """One line naming the host: CPU model, core count, Python and JAX versions."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass

    return (f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"jax {jax.__version__} ({jax.default_backend()})")


def git_revision() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=BENCHMARKS_PATH.parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """A GitHub markdown table; floats keep 4 significant digits."""
    def fmt(value):
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_section(name: str, title: str, body: str, command: str, path: Path = BENCHMARKS_PATH) -> None:
    """Replace (or append) section `name` of BENCHMARKS.md with `title`, `body`, the machine and the command."""
    section = (f"<!-- begin:{name} -->\n## {title}\n\n{body}\n\nMachine: {machine_description()}; "
               f"revision {git_revision()}.\nCommand: `{command}`\n<!-- end:{name} -->")
    text = path.read_text() if path.exists() else _HEADER
    begin, end = f"<!-- begin:{name} -->", f"<!-- end:{name} -->"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1]
        text = head + section + tail
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


def replace_subsection(name: str, label: str, body: str, command: str, path: Path = BENCHMARKS_PATH) -> None:
    """Replace (or append) the subsection `label` inside section `name` (created if missing), leaving the
    section's other subsections as they are: one benchmark, several runs (configs, topologies) side by side."""
    begin, end = f"<!-- begin:{name} -->", f"<!-- end:{name} -->"
    text = path.read_text() if path.exists() else _HEADER
    inner = ""
    if begin in text and end in text:
        inner = text.split(begin, 1)[1].split(end, 1)[0].strip("\n")
    sub_begin, sub_end = f"<!-- begin:{name}/{label} -->", f"<!-- end:{name}/{label} -->"
    sub = (f"{sub_begin}\n### {label}\n\n{body}\n\nMachine: {machine_description()}; revision {git_revision()}.\n"
           f"Command: `{command}`\n{sub_end}")
    if sub_begin in inner and sub_end in inner:
        head, rest = inner.split(sub_begin, 1)
        inner = head + sub + rest.split(sub_end, 1)[1]
    else:
        inner = (inner + "\n\n" + sub) if inner else sub
    section = f"{begin}\n{inner.strip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)
