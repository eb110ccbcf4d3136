"""The optional C extensions: `make setup`'s check (``python -m qdelay.extensions``) fails
when one this machine can build is missing, and where they are built they are what the
code runs (their Python twins only where they are not, or with QDELAY_NATIVE=0)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap

import pytest

from qdelay import extensions, wire
from qdelay.client import Outgoing, handoff
from qdelay.segments import native


def test_every_extension_this_machine_can_build_is_built():
    failed, skipped = extensions.check()
    assert failed == {}, failed
    # gcc, Python's headers and libxxhash-dev are on every machine `make setup` supports
    assert skipped == {}, skipped


def _built(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        pytest.fail(f"{name} was not built (python -m qdelay.extensions says why)")


@pytest.mark.skipif(os.environ.get("QDELAY_NATIVE") == "0", reason="QDELAY_NATIVE=0: the twins run on purpose")
def test_the_built_extensions_are_the_ones_in_use():
    wire_mod = _built("qdelay._wire")
    assert wire.native is wire_mod
    assert Outgoing.__new__ is wire_mod.new_outgoing
    codec = _built("qdelay.segments._codec")
    assert native.codec is codec
    gate = _built("qdelay._handoff")
    assert handoff.native is gate
    assert handoff.Gate is gate.Gate and handoff.open_all is gate.open_all
    assert type(handoff.Gate()) is gate.Gate


def _check_with(script: str) -> subprocess.CompletedProcess:
    """``python -m qdelay.extensions``' main in a fresh interpreter, after ``script``."""
    code = textwrap.dedent(script) + "\nfrom qdelay import extensions\nraise SystemExit(extensions.main())\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_check_passes_here():
    done = subprocess.run([sys.executable, "-m", "qdelay.extensions"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


def test_a_failed_build_fails_the_check():
    """An extension that does not import (as after a failed build: pip goes on, the twins
    would run) on a machine that can build it: exit 1, naming it."""
    done = _check_with(
        """
        import sys
        class NotBuilt:  # as if qdelay._handoff's build had failed
            def find_spec(self, name, path=None, target=None):
                if name == "qdelay._handoff":
                    raise ImportError("no module named qdelay._handoff")
                return None
        sys.meta_path.insert(0, NotBuilt())
        """
    )
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "error: the C extension qdelay._handoff was not built" in done.stderr
    assert "_wire" not in done.stderr and "_codec" not in done.stderr


def test_an_extension_this_machine_cannot_build_only_warns():
    """Where a header is missing (the storage codec's xxhash.h, say) the twins run: a
    warning, and the set-up goes on."""
    done = _check_with(
        """
        import sys
        from qdelay import extensions
        extensions.EXTENSIONS["qdelay._not_here"] = (("qdelay_no_such_header.h",), ())
        """
    )
    assert done.returncode == 0, done.stderr
    assert "warning: qdelay._not_here cannot be built here" in done.stderr
    assert "qdelay_no_such_header.h" in done.stderr


def test_cannot_build_names_a_missing_compiler(monkeypatch):
    monkeypatch.setattr(extensions.sysconfig, "get_config_var", lambda name: "qdelay-no-such-cc -pthread")
    assert extensions.cannot_build(()) == "no C compiler (qdelay-no-such-cc is not on the PATH)"


def test_the_checks_list_of_extensions_and_sources_is_pyprojects():
    """EXTENSIONS repeats what pyproject.toml builds (each module, its sources and depends):
    an extension added there, or a header it comes to depend on, must be checked too."""
    import pathlib
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[1]
    modules = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["ext-modules"]
    built = {m["name"]: tuple(m["sources"]) + tuple(m.get("depends", ())) for m in modules}
    assert {name: sources for name, (_headers, sources) in extensions.EXTENSIONS.items()} == built
