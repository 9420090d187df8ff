"""Errors raised when reading an HF checkpoint directory: one class per kind of defect, all `CheckpointError`s.

`CheckpointError` subclasses `ValueError`: a bad checkpoint is bad input (data that does not fit what the code
expects), not a failure of the program, and callers that already catch `ValueError` for bad configs catch these
too. Every message names the tensor or file at fault and says how to fix it; the subclasses let a caller (or a
test) tell the defects apart without matching text.
"""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint does not match its configuration or is damaged; the message names the tensor/file and the fix."""


class MissingShardError(CheckpointError):
    """A shard file the checkpoint needs is absent (or is a symlink to a file that does not exist)."""


class ShardIndexError(CheckpointError):
    """`model.safetensors.index.json` is malformed or disagrees with the shard files it lists."""


class ShardPathError(CheckpointError):
    """The index names a shard outside the checkpoint directory (an absolute path or one with `..`)."""


class SymlinkLoopError(CheckpointError):
    """A checkpoint path is a symlink chain that never reaches a file."""


class CorruptShardError(CheckpointError):
    """A shard (or config.json) cannot be parsed: truncated, not safetensors, or not JSON."""


class DuplicateTensorError(CheckpointError):
    """One tensor name is stored in two shard files (or listed twice in the index): which copy is meant is unknown."""


class CheckpointDtypeError(CheckpointError):
    """A weight is stored as integers or booleans (e.g. a quantized checkpoint); casting it to float would be wrong."""


class NonFiniteWeightError(CheckpointError):
    """A weight holds NaN or inf, in the file or after the cast to the requested dtype."""


class BadConfigValue(CheckpointError):
    """A `config.json` field has the wrong type or a value outside its range (a negative size, zero heads, more
    experts than the checkpoint stores); raised before any shape is derived or any name list is built."""
