"""Checkpoint files: atomic replacement, and corruption reported rather than guessed around."""

from __future__ import annotations

import os

import pytest
from byte_surgery import file_bytes, flip_byte, truncate_at

from qdelay.errors import CorruptRecord
from qdelay.segments import checkpoint, framing, naming
from qdelay.segments.framing import RecordKind


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / naming.CHECKPOINT_DIR / f"iterate{naming.CHECKPOINT_SUFFIX}")


def test_missing_checkpoint_reads_as_none(path):
    assert checkpoint.read(path) is None


def test_write_then_read(path):
    checkpoint.write(path, {"offset": 4096, "sequence": 30})
    assert checkpoint.read(path) == {"offset": 4096, "sequence": 30}
    frame = framing.check_at(file_bytes(path), 0)
    assert frame.kind == RecordKind.CHECKPOINT and frame.sequence == 0
    assert frame.body == b'{"offset":4096,"sequence":30}'


def test_replace_is_atomic_and_leaves_no_temp_file(path, monkeypatch):
    checkpoint.write(path, {"offset": 1, "sequence": 1})
    checkpoint.write(path, {"offset": 2, "sequence": 2})
    assert checkpoint.read(path) == {"offset": 2, "sequence": 2}
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]

    # a crash before the rename: the old checkpoint is still whole
    def crash(src, dst):
        raise KeyboardInterrupt("killed before the rename")

    monkeypatch.setattr(checkpoint.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.write(path, {"offset": 3, "sequence": 3})
    monkeypatch.undo()
    assert checkpoint.read(path) == {"offset": 2, "sequence": 2}
    checkpoint.write(path, {"offset": 4, "sequence": 4})  # a stale temp file does not get in the way
    assert checkpoint.read(path) == {"offset": 4, "sequence": 4}


@pytest.mark.parametrize("damage", ["flip_body", "flip_header", "truncate", "empty", "trailing"])
def test_corrupt_checkpoint_is_reported(path, damage):
    checkpoint.write(path, {"offset": 123456, "sequence": 789})
    size = os.path.getsize(path)
    if damage == "flip_body":
        flip_byte(path, size - 3)
    elif damage == "flip_header":
        flip_byte(path, 20)
    elif damage == "truncate":
        truncate_at(path, size - 1)
    elif damage == "empty":
        truncate_at(path, 0)
    else:
        with open(path, "ab") as f:
            f.write(b"x")
    with pytest.raises(CorruptRecord) as err:
        checkpoint.read(path)
    assert err.value.path == path
