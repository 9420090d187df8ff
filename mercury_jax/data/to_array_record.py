"""JSONL chat corpora to ArrayRecord files (indexed in the file, so no host scans a corpus at start-up):

    python -m mercury_jax.data.to_array_record --data "gs://bucket/sft/*.jsonl" --out /data/sft --records-per-file 4096

Each record is kept as its JSON line's bytes, in corpus order (record i stays record i), written as
`part-00000.array_record`, ... under `--out` (local or gs://).
"""
from __future__ import annotations

import argparse

from array_record.python.array_record_module import ArrayRecordWriter
from etils import epath

from mercury_jax.data.corpus import JsonlCorpus, corpus_files


def convert(spec: str, out: str, records_per_file: int = 4096) -> list[str]:
    """Write the JSONL corpus `spec` as ArrayRecord files under `out`; returns their paths."""
    corpus = JsonlCorpus(corpus_files(spec))
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
    args = parser.parse_args(argv)
    files = convert(args.data, args.out, args.records_per_file)
    print(f"wrote {len(files)} ArrayRecord files to {args.out}")


if __name__ == "__main__":
    main()
