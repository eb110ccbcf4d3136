"""qdelay benchmarks: ``python -m bench.<name>`` (see docs/benchmarks.md)."""

from __future__ import annotations

import os
import sys


def require_built() -> None:
    """Refuse to measure with a C extension that this machine can build but that is missing
    or older than its source (``make setup``'s native check): its figures would be the
    Python twins' or an older build's, not this code's. A stale codec once made every
    qdelay run of bench.compare hang (the WAL writer called a function the old build
    lacked). ``QDELAY_NATIVE=0`` (the twins on purpose) skips it."""
    if os.environ.get("QDELAY_NATIVE", "1") == "0":
        return
    from qdelay.extensions import check

    failed, _ = check()
    if failed:
        why = "; ".join(f"{name}: {reason}" for name, reason in failed.items())
        raise SystemExit(f"bench: the C extensions are not built from this source ({why}); run `make setup` first")


# run as ``python -m bench.<name>`` (sys.argv[0] is "-m" while the package is imported to
# find the module); importing bench from the tests asks nothing
if sys.argv and sys.argv[0] == "-m":
    require_built()
