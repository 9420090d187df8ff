"""`python -m mercury_jax.main` ends a run that cannot start in one `error:` line on stderr and exit status 2
(`cli_errors.EXIT_REFUSED`), before any work: a missing config file, an override of the wrong type, a config that
fails validation, a workdir that is a file or cannot be created. In process through `_parse_flags` / `main` (the
module is slow to start as a subprocess), and once end to end."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mercury_jax import main as cli

REPO = Path(__file__).resolve().parents[1]


def _refusal(call) -> str:
    """The message `call` exits with: one `error:` line (a SystemExit with a text code; the entry point's
    `cli_errors.run_entry_point` prints it and exits 2)."""
    with pytest.raises(SystemExit) as exited:
        call()
    message = exited.value.code
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message, message
    return message


@pytest.fixture
def parse(monkeypatch):
    """`_parse_flags` on `main ARGS` (config_flags finds the `--config.x=` overrides in sys.argv, as in a run)."""
    def parse(*args: str):
        monkeypatch.setattr(sys, "argv", ["main", *args])
        return cli._parse_flags(sys.argv)
    return parse


def _run_main(parse, *args: str) -> str:
    parse(*args)
    return _refusal(lambda: cli.main(["main"]))


def test_a_missing_config_file_is_one_line(parse, tmp_path):
    message = _refusal(lambda: parse("--config", f"{tmp_path}/nope.py:tiny"))
    assert message == (f"error: --config {tmp_path}/nope.py: no such config file; pass an experiment file, e.g. "
                       f"--config experiments/sao.py:tiny")


def test_a_config_file_that_raises_gives_its_last_line(parse):
    message = _refusal(lambda: parse("--config", "experiments/sft.py:bogus"))
    assert message.endswith("ValueError: unknown variant 'bogus' of experiments/sft.py; "
                            "use ':tiny' or ':long' or nothing")


@pytest.mark.parametrize("override, expected", [
    ("--config.sft.steps=abc", "invalid literal for int() with base 10: 'abc'"),
    ("--config.sft.optimizer.lr=fast", "could not convert string to float: 'fast'"),
])
def test_an_override_of_the_wrong_type_is_one_line(parse, override, expected):
    message = _refusal(lambda: parse("--config", "experiments/sft.py:tiny", override))
    assert message == f"error: flag {override}: {expected}"


def test_a_config_that_fails_validation_is_one_line(parse, tmp_path):
    message = _run_main(parse, "--config", "experiments/sao.py:tiny", "--config.sao.batch_prompts=0",
                        "--workdir", str(tmp_path / "run"))
    assert message == "error: sao.batch_prompts is 0; expected a whole number >= 1: prompts a step, one rollout each"
    assert not (tmp_path / "run").exists()  # refused before the workdir is made


@pytest.mark.parametrize("where, expected", [
    ("file", "is a file, not a directory"),
    ("file/run", "cannot be created (Not a directory: "),
])
def test_a_workdir_that_cannot_be_a_directory_is_one_line(parse, tmp_path, where, expected):
    (tmp_path / "file").write_text("not a run")
    message = _run_main(parse, "--config", "experiments/sft.py:tiny", "--workdir", str(tmp_path / where))
    assert message.startswith(f"error: --workdir {tmp_path / where} ") and expected in message, message


def test_end_to_end_the_refusal_is_the_only_line_on_stderr(tmp_path):
    (tmp_path / "file").write_text("not a run")
    result = subprocess.run([sys.executable, "-m", "mercury_jax.main", "--config", "experiments/sft.py:tiny",
                             "--workdir", str(tmp_path / "file")], cwd=REPO, capture_output=True, text=True,
                            timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"error: --workdir {tmp_path / 'file'} is a file, not a directory; pass a "
                                          f"directory (a new one, or a run's to resume it)"], result.stderr[-3000:]
