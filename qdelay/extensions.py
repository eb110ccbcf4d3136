"""Loading the optional C extensions (``qdelay._wire``, ``qdelay._handoff``,
``qdelay.segments._codec``), and the set-up's check that they were built.

Each is optional: where it was not built, or ``QDELAY_NATIVE=0`` is set (tests compare the
two paths), the Python twins beside it run instead. That fallback is silent at run time, so
``make setup`` runs ``python -m qdelay.extensions``: it fails, naming the module and the
reason, when an extension that this machine can build (a C compiler, Python's headers, and
the storage codec's ``xxhash.h``) is not importable; where a prerequisite is missing it
only warns (the twins run, slower).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import sysconfig
from types import ModuleType

# every optional extension: the system headers its source includes beyond Python.h, and its
# sources in the repository (pyproject.toml's sources and depends)
EXTENSIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "qdelay._wire": ((), ("qdelay/_wire.c", "segments/layout.h", "segments/pyint.h")),
    "qdelay._handoff": ((), ("qdelay/_handoff.c",)),
    "qdelay.segments._codec": (("xxhash.h",), ("segments/_codec.c", "segments/layout.h", "segments/pyint.h")),
}


def optional(name: str) -> ModuleType | None:
    """The extension module ``name``, or None when it is not built or switched off."""
    if os.environ.get("QDELAY_NATIVE", "1") == "0":
        return None
    try:
        return importlib.import_module(name)
    except ImportError:  # not built: the Python twins run
        return None


def cannot_build(headers: tuple[str, ...]) -> str | None:
    """Why this machine cannot build an extension that includes ``headers`` (and Python.h),
    or None when it can: the compiler Python was built with must be on the PATH and find
    them (asked of its preprocessor, so that its own include paths count)."""
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    if not cc or shutil.which(cc[0]) is None:
        return f"no C compiler ({cc[0] if cc else 'cc'} is not on the PATH)"
    source = "".join(f"#include <{h}>\n" for h in ("Python.h", *headers))
    argv = [*cc, "-E", "-x", "c", "-o", os.devnull, "-I", sysconfig.get_paths()["include"], "-"]
    try:
        done = subprocess.run(argv, input=source, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"the C compiler could not be run: {err}"
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if "error" in line]
        return "a header is missing: " + (lines[0].strip() if lines else done.stderr.strip()[:200])
    return None


def stale(module: ModuleType, sources: tuple[str, ...]) -> str | None:
    """Which of ``sources`` (paths from the repository's root) changed after ``module`` was
    built, or None. An editable install builds in place, next to the sources, so a failed
    rebuild leaves the old build importable; outside a repository (a wheel) there is
    nothing to compare."""
    built = pathlib.Path(module.__file__ or "")
    root = built.parents[1] if len(built.parents) > 1 else built
    for source in sources:
        path = root / source
        if path.is_file() and path.stat().st_mtime > built.stat().st_mtime:
            return f"{source} changed after {built.name} was built"
    return None


def stale_builds() -> dict[str, str]:
    """The extensions this process loads (:func:`optional`) that were built before one of
    their sources last changed, by module name with :func:`stale`'s reason: a source tree
    whose ``make setup`` failed or was not run again (a WAL writer that called a function
    the old codec lacked). Empty in an installed package (no source beside the build),
    with ``QDELAY_NATIVE=0`` (no build loaded), and for an extension that is not built
    (its Python twins run: slower, not wrong)."""
    found: dict[str, str] = {}
    for name, (_headers, sources) in EXTENSIONS.items():
        try:
            module = optional(name)
        except ImportError:  # its package is not installed (the light client has no storage package)
            continue
        why = stale(module, sources) if module is not None else None
        if why is not None:
            found[name] = why
    return found


def check(
    extensions: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] | None = None,
) -> tuple[dict[str, str], dict[str, str]]:
    """(failed, skipped) of ``extensions`` (default: :data:`EXTENSIONS`), each by module name
    with the reason: failed, those this machine can build but that do not import or were
    built before their sources last changed (their build failed: pip goes on without an
    optional extension); skipped, those it cannot build. Only those whose package is
    installed are asked (the client distribution has no storage package).
    ``QDELAY_NATIVE`` plays no part: this asks what was built."""
    failed: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for name, (headers, sources) in (EXTENSIONS if extensions is None else extensions).items():
        package = name.rpartition(".")[0]
        try:
            if importlib.util.find_spec(package) is None:
                continue
        except ImportError:
            continue
        try:
            error = stale(importlib.import_module(name), sources)
        except ImportError as err:
            error = f"{type(err).__name__}: {err}"
        if error is None:
            continue
        why = cannot_build(headers)
        if why is None:
            failed[name] = error
        else:
            skipped[name] = why
    return failed, skipped


def main() -> int:
    """``python -m qdelay.extensions``: 1 (and what failed, to stderr) when an extension this
    machine can build did not import; a warning for those it cannot build."""
    failed, skipped = check()
    for name, why in skipped.items():
        print(f"warning: {name} cannot be built here ({why}); its Python twins run, slower", file=sys.stderr)
    for name, why in failed.items():
        print(f"error: the C extension {name} was not built, though this machine can build it: {why}", file=sys.stderr)
    if failed:
        print(
            "The build's output says why: `.venv/bin/pip install -v -e .` (after fixing it, `make setup` "
            "builds again).",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
