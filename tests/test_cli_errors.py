"""How the entry points end (`mercury_jax/cli_errors.py`): the project's own errors as one `error:` line and exit
status 2, the traceback only with `--debug` / MERCURY_DEBUG=1, a bug's traceback untouched, 143 passed through; and
the probes of issue #55 (round 3) that end in `python -m mercury_jax.main`: every config mismatch on resume (a run
whose config.json names an unregistered pipeline, `--config.seed=1` on a finished run), an SFT corpus changed
between a kill and the resume, a `gs://` workdir without gcsfs or with `..`. In process (`main` is slow to start as
a subprocess; tests/test_main_cli.py runs it once end to end)."""
from __future__ import annotations

import functools
import importlib
import json
import sys

import pytest

from mercury_jax import cli_errors, export, sweep
from mercury_jax import main as cli
from mercury_jax.data.chat_records import BadRecord
from mercury_jax.data.synthetic import write_corpus
from mercury_jax.runs.preemption import Preempted
from mercury_jax.runs.resume import ResumeError, check_corpus
from mercury_jax.runs.run_guard import _leave_after_failure
from mercury_jax.runs.rundir import RunDir


def refusal_line(capsys, body, argv=()) -> str:
    """The line `body` ends with through the entry-point wrapper: exit 2 and exactly one line on stderr."""
    with pytest.raises(SystemExit) as exited:
        cli_errors.run_entry_point(body, list(argv))
    assert exited.value.code == cli_errors.EXIT_REFUSED
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err.strip()


def bad_record_with_a_note():
    error = BadRecord(7, "chats.jsonl:8", "'messages' is missing or not a non-empty list")
    error.add_note("For simplicity, Grain has removed its internal frames from the traceback")
    raise error


# ------------------------------------------------------------------------------------------------ the wrapper
def test_a_project_error_is_one_line_and_exit_2_without_its_notes(capsys):
    line = refusal_line(capsys, bad_record_with_a_note)
    assert line.startswith("error: SFT record 7 (chats.jsonl:8): 'messages' is missing") and "Grain" not in line
    assert "sft.skip_bad_records=True" in line


def test_an_error_line_of_the_entry_point_itself_exits_2(capsys):
    def refuse():
        raise SystemExit("error: --workdir x is a file, not a directory")
    assert refusal_line(capsys, refuse) == "error: --workdir x is a file, not a directory"


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_debug_prints_the_traceback_above_the_error_line(capsys, monkeypatch, how):
    if how == "environment":
        monkeypatch.setenv(cli_errors.DEBUG_ENV, "1")
    with pytest.raises(SystemExit) as exited:
        cli_errors.run_entry_point(bad_record_with_a_note, ["--debug"] if how == "flag" else [])
    assert exited.value.code == cli_errors.EXIT_REFUSED
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "Traceback (most recent call last):" and "bad_record_with_a_note" in "\n".join(err)
    assert err[-1].startswith("error: SFT record 7")


def test_a_bug_keeps_its_traceback_and_a_preemption_its_status(monkeypatch):
    monkeypatch.delenv(cli_errors.DEBUG_ENV, raising=False)
    with pytest.raises(KeyError):  # not caught: Python prints the traceback and exits 1
        cli_errors.run_entry_point(lambda: {}["missing"])
    with pytest.raises(SystemExit) as exited:
        cli_errors.run_entry_point(lambda: (_ for _ in ()).throw(Preempted(step=3, signum=15)))
    assert exited.value.code == cli_errors.EXIT_PREEMPTED == 143 and cli_errors.EXIT_PEER_LOST == 75


def test_a_multi_process_run_that_fails_reports_as_the_entry_point_would(capsys):
    """Inside `run_guard` a failed process of a multi-process run leaves at once (`os._exit`, past the entry
    point): main hands it `cli_errors.report`, so a resume refused on a pod is one line and status 2 there too."""
    class Watch:
        def after_failure(self, error):
            self.told = error

    report, statuses = functools.partial(cli_errors.report, debug=False), []
    for error in (ResumeError("the config differs"), SystemExit("error: in use"), Preempted(3, 15), KeyError("x")):
        watch = Watch()
        _leave_after_failure(watch, error, report, exit_process=statuses.append)
        assert watch.told is error
    assert statuses == [2, 2, 143, 1]
    # the KeyError never ran, so its "traceback" is the last line alone
    assert capsys.readouterr().err == "error: the config differs\nerror: in use\nKeyError: 'x'\n"


def test_a_multi_line_message_becomes_one_line():
    assert cli_errors.refusal(ResumeError("first\n  second\n\nthird")) == "first; second; third"
    assert cli_errors.refusal(ValueError("a bug")) is None


# ------------------------------------------------------------------------------------------------ main's probes
@pytest.fixture
def parse(monkeypatch):
    """`_parse_flags` on `main ARGS` (config_flags reads the `--config.x=` overrides from sys.argv, as in a run);
    returns the parsed config."""
    def parse(*args: str):
        monkeypatch.setattr(sys, "argv", ["main", *args])
        cli._parse_flags(sys.argv)
        return cli._CONFIG.value
    return parse


def run_main(capsys) -> str:
    line = refusal_line(capsys, lambda: cli.main(["main"]))
    capsys.readouterr()
    return line


def test_config_seed_on_a_finished_run_is_one_line(parse, capsys, tmp_path):
    finished = parse("--config", "experiments/sft.py:tiny", "--workdir", str(tmp_path))
    RunDir(tmp_path).write_config(finished)
    (tmp_path / "sft" / "checkpoints" / "3" / "arrays").mkdir(parents=True)
    before = (tmp_path / "config.json").read_text()
    parse("--config", "experiments/sft.py:tiny", "--config.seed=1", "--workdir", str(tmp_path))
    line = run_main(capsys)
    assert line.startswith(f"error: {tmp_path} holds a run whose config differs") and "seed: 0 in the workdir's run, " \
        "1 now" in line and line.endswith("or pass --resume_force_config to resume anyway"), line
    assert (tmp_path / "config.json").read_text() == before


def test_a_run_whose_config_names_an_unregistered_pipeline_is_one_line(parse, capsys, tmp_path):
    config = json.loads(parse("--config", "experiments/sft.py:tiny").to_json_best_effort())
    (tmp_path / "config.json").write_text(json.dumps({**config, "pipeline": "dpo"}))
    parse("--config", "experiments/sft.py:tiny", "--workdir", str(tmp_path))
    line = run_main(capsys)
    assert "pipeline: 'dpo' in the workdir's run, 'sft' now" in line, line


def test_a_corpus_changed_between_kill_and_resume_is_refused_unless_forced(parse, capsys, tmp_path):
    corpus, workdir = tmp_path / "chats.jsonl", tmp_path / "run"
    write_corpus(corpus, 40, words=20)
    config = parse("--config", "experiments/sft.py:tiny", f"--config.sft.data={corpus}", "--workdir", str(workdir))
    RunDir(workdir).write_config(config)
    assert check_corpus(workdir, config) == []  # what main records when the run starts
    started = json.loads((workdir / "sft_corpus.json").read_text())
    assert started["files"][0]["file"] == str(corpus) and started["files"][0]["bytes"] == corpus.stat().st_size
    write_corpus(corpus, 50, words=20, seed=1)  # killed; the corpus regenerated: more records, another order
    line = run_main(capsys)
    assert line.startswith(f"error: {workdir} holds a run whose SFT corpus changed since it started") and \
        f"{corpus} had {started['files'][0]['bytes']} bytes" in line and "--resume_force_config" in line, line
    with pytest.warns(UserWarning, match="changed SFT corpus"):
        assert check_corpus(workdir, config, force=True)
    assert check_corpus(workdir, config) == []  # the forced resume recorded the corpus it now reads


@pytest.fixture
def no_gcsfs(monkeypatch):
    """fsspec as it is without gcsfs (whether or not it is installed, or served from a folder by another test)."""
    tables = importlib.import_module("fsspec.registry")  # `fsspec.registry` is the read-only view of its table
    for protocol in ("gs", "gcs"):
        monkeypatch.delitem(tables._registry, protocol, raising=False)  # noqa: SLF001 - fsspec's own table
        monkeypatch.setitem(tables.known_implementations, protocol, {
            "class": "gcsfs_not_installed.GCSFileSystem", "err": "Please install gcsfs to access Google Storage"})


def test_a_gs_workdir_without_gcsfs_is_one_line_naming_the_install(parse, capsys, tmp_path, no_gcsfs):
    parse("--config", "experiments/sft.py:tiny", "--workdir", "gs://bucket/runs/sft")
    assert run_main(capsys) == ("error: --workdir gs://bucket/runs/sft: gs:// paths need the optional package "
                                "gcsfs, which is not installed; run `pip install gcsfs` (and authenticate, e.g. "
                                "`gcloud auth application-default login`), or use a local path")


def test_dot_dot_in_a_gs_workdir_is_refused(parse, capsys):
    parse("--config", "experiments/sft.py:tiny", "--workdir", "gs://bucket/runs/../sft")
    line = run_main(capsys)
    assert line == ("error: --workdir gs://bucket/runs/../sft: a remote path must not hold '.' or '..' segments "
                    "(object stores keep them as written); write it out, e.g. gs://bucket/sft")


@pytest.mark.parametrize("entry_point", [export.main, sweep.main])
@pytest.mark.parametrize("workdir, problem", [
    ("gs://bucket/runs/grpo", "gs:// paths need the optional package gcsfs, which is not installed; run `pip install "
                              "gcsfs`"),
    ("gs://bucket/runs/./grpo", "a remote path must not hold '.' or '..' segments (object stores keep them as "
                                "written); write it out, e.g. gs://bucket/runs/grpo")])
def test_the_export_and_the_sweep_refuse_a_gs_run_they_cannot_read_in_one_line(capsys, tmp_path, no_gcsfs,
                                                                              entry_point, workdir, problem):
    with pytest.raises(SystemExit) as exited:
        entry_point(["--workdir", workdir, "--out", str(tmp_path / "out")])
    assert exited.value.code == cli_errors.EXIT_REFUSED
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"error: run directory {workdir}: {problem}"), err
