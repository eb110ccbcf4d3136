"""Moved to :mod:`qdelay.segments.bucket_log` (storage lives in segments/). Kept for the
scheduler and the iterate service, which import it from here until their rewrite lands."""

from qdelay.segments.bucket_log import BucketLog, sync_all, sync_dirs  # noqa: F401
