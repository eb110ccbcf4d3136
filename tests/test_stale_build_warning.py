"""A server started from a source tree whose C extension is older than its source logs one
WARNING naming the file (a stale codec once made the WAL writer fail); a fresh build, and
an installed package (no source beside the build), say nothing. Real server processes,
each run from a copy of the package laid out as installed (qdelay/, qdelay/segments/, ...)
in a temporary folder, first on PYTHONPATH: the copy's files are touched, never the
work tree's (the other tests check its build)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from serverproc import ServerProc

ROOT = Path(__file__).resolve().parents[1]
# pyproject.toml's package-dir: each import package and the folder it comes from
PACKAGES = {
    "qdelay": "qdelay",
    "qdelay/segments": "segments",
    "qdelay/server": "server",
    "qdelay/replication": "replication",
    "qdelay/tools": "tools",
    "qdelay/client": "client",
    "qdelay/v1": "proto/qdelay/v1",
}
WARNING = "a C extension is older than its source"


def _copy(into: Path, sources: bool) -> Path:
    """The package as installed under ``into``, with its C sources beside the builds or
    without them (a wheel); mtimes kept (copy2), so the builds stay newer than their sources."""
    skip = ["__pycache__"] + ([] if sources else ["*.c", "*.h"])
    for package, folder in PACKAGES.items():
        # the subpackages' folders are copied on their own (they are not inside qdelay/ here)
        shutil.copytree(ROOT / folder, into / package, ignore=shutil.ignore_patterns(*skip), dirs_exist_ok=True)
    return into


def _start_log(tree: Path, data: Path) -> list[dict]:
    """The log lines of a real server run from ``tree`` until it listens, then stopped."""
    env = {"PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    env["QDELAY_NATIVE"] = "1"
    # -P: the current folder (the work tree, whose qdelay/ is a package too) not on sys.path
    command = [sys.executable, "-P", "-m", "qdelay.cli"]
    with ServerProc(data, args=["--set", "log_format=json"], env=env, command=command) as srv:
        srv.stop()
        text = srv.tail_log(1_000_000)
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert any(line["msg"] == "started" for line in lines), text
    return lines


def _codec_build(tree: Path) -> Path:
    (built,) = (tree / "qdelay/segments").glob("_codec*.so")
    return built


def test_a_touched_source_warns_once_naming_it(tmp_path):
    tree = _copy(tmp_path / "tree", sources=True)
    later = time.time() + 60
    os.utime(tree / "qdelay/segments/_codec.c", (later, later))  # edited after the build
    lines = _start_log(tree, tmp_path / "data")
    warned = [line for line in lines if line["msg"].startswith(WARNING)]
    assert len(warned) == 1, lines
    assert warned[0]["level"] == "warning" and warned[0]["logger"] == "qdelay.server"
    why = f"segments/_codec.c changed after {_codec_build(tree).name} was built"
    assert warned[0]["stale"] == f"qdelay.segments._codec: {why}"


def test_a_fresh_build_says_nothing(tmp_path):
    lines = _start_log(_copy(tmp_path / "tree", sources=True), tmp_path / "data")
    assert not [line for line in lines if line["msg"].startswith(WARNING)], lines


def test_an_installed_package_says_nothing(tmp_path):
    """No source beside the build: nothing to compare, even with a build older than anything."""
    tree = _copy(tmp_path / "tree", sources=False)
    os.utime(_codec_build(tree), (0, 0))
    assert not list(tree.rglob("*.c"))
    lines = _start_log(tree, tmp_path / "data")
    assert not [line for line in lines if line["msg"].startswith(WARNING)], lines
