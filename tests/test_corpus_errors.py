"""The SFT corpus under bad input (issue #55, round 3 probes): each ends in one `error:` line naming the file and the
fix (`cli_errors.run_entry_point`, as `python -m mercury_jax.main` ends), and grain's worker processes do not outlive
a trainer killed by SIGKILL.

- an empty corpus file; a truncated ArrayRecord file (its name, not a bare RuntimeError); a bad record (index,
  file:line, problem and fix, without grain's traceback note);
- `sft.data_workers=2`: SIGKILL of the trainer alone, as the OOM killer sends it, and both workers and the resource
  tracker are gone within seconds (`sft_rows.exit_with_parent`). A real process: the one test here that needs one.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mercury_jax import cli_errors
from mercury_jax.chat import qwen35_tokenizer
from mercury_jax.data.corpus import chat_corpus
from mercury_jax.data.sft_rows import RowSpec, shard_rows
from mercury_jax.data.synthetic import write_corpus
from mercury_jax.data.to_array_record import convert

REPO = Path(__file__).resolve().parents[1]


def refusal_line(capsys, body) -> str:
    with pytest.raises(SystemExit) as exited:
        cli_errors.run_entry_point(body, [])
    assert exited.value.code == cli_errors.EXIT_REFUSED
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err.strip()


def test_an_empty_corpus_file_is_one_line(capsys, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert refusal_line(capsys, lambda: chat_corpus(str(empty))) == (
        f"error: sft.data '{empty}' holds no record ({empty}: empty); give a corpus with at least one chat record "
        f"(docs/DATA.md \"Record format\")")


@pytest.mark.parametrize("size", [0, 3000, 100_000])
def test_a_truncated_array_record_file_is_named(capsys, tmp_path, size):
    write_corpus(tmp_path / "chats.jsonl", 40, words=40)
    good, cut = convert(str(tmp_path / "chats.jsonl"), str(tmp_path / "ar"), records_per_file=20)
    with open(cut, "r+b") as file:
        file.truncate(size)
    line = refusal_line(capsys, lambda: chat_corpus(f"{good},{cut}"))
    assert line.startswith(f"error: {cut} is not a readable ArrayRecord file (RuntimeError") and line.endswith(
        "it is truncated or damaged; rewrite it (python -m mercury_jax.data.to_array_record) or leave it out of "
        "sft.data"), line


def test_a_bad_record_is_one_line_not_grains_traceback(capsys, tmp_path):
    corpus = tmp_path / "chats.jsonl"
    write_corpus(corpus, 6, words=10)
    with corpus.open("a") as file:
        file.write('{"messages": []}\n')
    spec = RowSpec(row_length=4096, rows_per_shard=7, shards=1, seed=0)

    def read_a_step():
        next(iter(shard_rows(chat_corpus(str(corpus)), qwen35_tokenizer(), spec, 0)))

    assert refusal_line(capsys, read_a_step) == (
        f"error: SFT record 6 ({corpus}:7): 'messages' is missing or not a non-empty list. Fix or remove the record, "
        f"or set sft.skip_bad_records=True to skip such records (they are counted in the SFT metrics as bad_records)")


TRAINER = """
import os, sys, time
from mercury_jax.data.corpus import InMemoryCorpus
from mercury_jax.data.sft_rows import RowSpec, shard_rows

if __name__ == "__main__":
    records = [{"tokens": [1, 2, 3], "loss_mask": [0, 1, 1]}] * 64
    steps = iter(shard_rows(InMemoryCorpus(records), None, RowSpec(row_length=16, rows_per_shard=2, shards=1, seed=0,
                                                                    workers=2), 0))
    next(steps)  # the workers run
    print("ready", flush=True)
    time.sleep(600)
"""


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):  # a process that ended while listed
            continue
    return found


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's parent may be a pid 1 that does not reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_grain_workers_exit_when_their_trainer_is_sigkilled(tmp_path):
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER], cwd=REPO, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)})
    children = []
    try:
        assert trainer.stdout.readline().strip() == "ready"
        children = children_of(trainer.pid)  # two workers and multiprocessing's resource tracker
        assert len(children) >= 2 and all(running(pid) for pid in children), children
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=30)
        deadline = time.monotonic() + 120  # a worker still starting (imports under load) exits when it gets going
        while any(running(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [pid for pid in children if running(pid)]
        assert not left, f"still running 120 s after the trainer's SIGKILL: {left}"
    finally:
        if trainer.poll() is None:
            trainer.kill()
        for pid in children:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_worker_that_starts_after_its_trainer_died_exits_at_once():
    """The race under load: a worker whose init runs only after the trainer's SIGKILL saw pid 1 as its parent and
    took it for the trainer, so it never left. Planted: `parent = os.getppid()` whatever `trainer_pid` says."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    code = ("import time\nfrom mercury_jax.data.sft_rows import exit_with_parent\n"
            f"exit_with_parent(1, 2, trainer_pid={gone.pid})\ntime.sleep(60)")
    worker = subprocess.run([sys.executable, "-c", code],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                            timeout=50)
    assert worker.returncode == 1 and f"its trainer (pid {gone.pid}) is gone" in worker.stderr

