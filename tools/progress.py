"""A small progress bar for long scans, drawn on stderr only when stderr is a terminal.

Hand-written (no dependency): ``qdelay inspect`` must stay importable with the server's
dependencies alone. It draws nothing for the first half second, so short scans and every
non-terminal run (pipes, files, CI, golden tests) produce plain output only.
"""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(
        self, total: int, label: str = "scanning", stream=None, enabled: bool | None = None, delay: float = 0.5
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self.total = max(total, 1)
        self.label = label
        self.done = 0
        self.started = time.monotonic()
        self.delay = delay
        self._last_draw = 0.0
        self._drawn = False

    def advance(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.started < self.delay or now - self._last_draw < 0.1:
            return
        self._last_draw = now
        self._draw(now)

    def _draw(self, now: float) -> None:
        frac = min(self.done / self.total, 1.0)
        width = 30
        filled = int(frac * width)
        rate = self.done / max(now - self.started, 1e-9) / 1e6
        line = (
            f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {frac * 100:5.1f}% "
            f"{self.done / 1e6:,.1f}/{self.total / 1e6:,.1f} MB {rate:,.1f} MB/s"
        )
        try:
            self.stream.write(line)
            self.stream.flush()
        except (OSError, ValueError):
            self.enabled = False
            return
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            try:
                self.stream.write("\r" + " " * 90 + "\r")
                self.stream.flush()
            except (OSError, ValueError):
                pass
            self._drawn = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
