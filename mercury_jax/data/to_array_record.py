"""JSONL chat corpora to ArrayRecord files (indexed in the file, so no host scans a corpus at start-up):

    python -m mercury_jax.data.to_array_record --data "gs://bucket/sft/*.jsonl" --out /data/sft --records-per-file 4096

Each record is kept as its JSON line's bytes, in corpus order (record i stays record i), written as
`part-00000.array_record`, ... under `--out` (local or gs://; gs:// needs the optional package gcsfs).

Exit codes (`cli/ending.py`): 0 done; 2 refused, one `error:` line on stderr (`--data` names no file, a file that
cannot be read or written, a gs:// path without gcsfs; `--debug` or MERCURY_DEBUG=1 adds the traceback); 1 a bug,
with its traceback.
"""
from __future__ import annotations

import argparse

from array_record.python.array_record_module import ArrayRecordWriter
from etils import epath

from mercury_jax.cli import ending
from mercury_jax.data.chat_records import BadRecord
from mercury_jax.data.corpus import CorpusError, JsonlCorpus, corpus_files
from mercury_jax.data.uris import RemotePathError, check_remote


def convert(spec: str, out: str, records_per_file: int = 4096) -> list[str]:
    """Write the JSONL corpus `spec` as ArrayRecord files under `out`; returns their paths."""
    corpus = JsonlCorpus(corpus_files(spec, "--data"))
    check_remote(out, "--out")
    epath.Path(out).mkdir(parents=True, exist_ok=True)
    written = []
    for first in range(0, len(corpus), records_per_file):
        written.append(str(epath.Path(out) / f"part-{len(written):05d}.array_record"))
        writer = ArrayRecordWriter(written[-1], "group_size:1")
        for index in range(first, min(first + records_per_file, len(corpus))):
            writer.write(corpus[index][1].rstrip(b"\n"))
        writer.close()
    return written


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="JSONL files, globs or directories, comma-separated")
    parser.add_argument("--out", required=True)
    parser.add_argument("--records-per-file", type=int, default=4096)
    ending.add_debug_flag(parser)
    args = parser.parse_args(argv)
    refusals = (CorpusError, BadRecord, RemotePathError, OSError)  # OSError: an unreadable input, an unwritable --out
    files = ending.run_entry_point(lambda: convert(args.data, args.out, args.records_per_file), refusals, argv)
    print(f"wrote {len(files)} ArrayRecord files to {args.out}")


if __name__ == "__main__":
    main()
