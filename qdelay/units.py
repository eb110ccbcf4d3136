"""Durations and counts in words for messages people read ("2 years", "30 minutes", "1 day
2 hours", "1 segment", "3 problems").

Shared by the server's validation (limits in its refusals) and the clients (their own
checks), so one limit reads the same wherever it is reported.
"""

from __future__ import annotations

from datetime import timedelta

# the server's year: 365 days (max_delay_ms defaults to 2 of them)
_UNITS = (
    ("year", 365 * 86_400_000),
    ("day", 86_400_000),
    ("hour", 3_600_000),
    ("minute", 60_000),
    ("second", 1000),
    ("ms", 1),
)


def ms_in_words(ms: int, parts: int = 2) -> str:
    """``63072000000`` -> ``'2 years'``; ``90061001`` -> ``'1 day 1 hour'`` (the ``parts``
    largest units, rounded down); negative values get a leading minus."""
    if ms < 0:
        return "-" + ms_in_words(-ms, parts)
    if ms == 0:
        return "0 ms"
    words = []
    for name, size in _UNITS:
        n, ms = divmod(ms, size)
        if n:
            words.append(f"{n} {name}" if name == "ms" or n == 1 else f"{n} {name}s")
            if len(words) == parts:
                break
    return " ".join(words)


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``counted(1, "problem")`` -> ``'1 problem'``, ``counted(0, "problem")`` -> ``'0 problems'``:
    the noun agrees with the count (``plural`` where adding "s" is wrong)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def limit_in_words(ms: int, key: str = "max_delay_ms") -> str:
    """``'2 years (max_delay_ms=63072000000)'``: a limit as a person and a config file say it."""
    return f"{ms_in_words(ms, parts=3)} ({key}={ms})"


def to_ms(value: int | float | timedelta, what: str = "delay") -> int:
    """A delay given as ms (int) or a :class:`datetime.timedelta` -> whole ms (a timedelta is
    rounded down to the ms). Raises TypeError for anything else (a float is refused: ms
    are whole, and seconds-vs-ms mistakes hide in floats)."""
    if isinstance(value, timedelta):
        return (value.days * 86_400 + value.seconds) * 1000 + value.microseconds // 1000
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what}: an int of milliseconds or a datetime.timedelta, not {type(value).__name__}")
    return value
