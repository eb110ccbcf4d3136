"""Moved to :mod:`qdelay.segments.lookup` (storage lives in segments/). Kept for the
scheduler and the iterate service, which import it from here until their rewrite lands."""

from qdelay.segments.lookup import DispatchIndex, RecordFinder, read_frames  # noqa: F401
