"""Consumer groups: which groups each subject has, and since when each one receives.

Every group of a subject receives every message of that subject that becomes due while the
group exists (fan-out); consumers inside a group compete. A group is created by its first
Subscribe (or ``qdelay admin group create``) and lives until deleted.

A message is *for* a group when its due time is at or after the group's ``since``. A group
created while its subject has other groups gets ``since`` = its creation time. A group
created while its subject has none inherits what the subject kept meanwhile: its ``since``
is when the subject's last group was deleted (or the beginning of time), so messages that
became due with nobody to receive them wait for the first group.

Durability and replication: a change is a GROUP record in the message log (written before
it takes effect, so a slave replays it and a crash keeps it), and the whole table is saved
with the iterate checkpoint; replaying a record the table already reflects changes nothing.

Owned by the scheduler (read and changed under its lock); group ids are small integers
that live in memory only: records name groups by their names.
"""

from __future__ import annotations

from dataclasses import dataclass

from qdelay.segments.records import DEFAULT_GROUP, group_bytes

BEGINNING = -(2**62)  # "since the beginning": every due time is at or after it


@dataclass(slots=True)
class Group:
    gid: int
    subject: str
    name: str
    since: int  # messages due at or after this are for the group
    created_ms: int
    stored: bytes  # the name as DISPATCH records store it (empty for the default group)


class GroupTable:
    def __init__(self) -> None:
        self._by_subject: dict[str, dict[str, Group]] = {}
        self._by_gid: dict[int, Group] = {}
        self._by_name: dict[str, dict[str, Group]] = {}  # group name -> subject -> group
        # subject -> when its last group was deleted (it keeps due messages from then on)
        self._kept_since: dict[str, int] = {}
        self._next_gid = 1
        self.version = 0  # bumped on every change (callers cache per-subject lookups)
        # the sequence of the last GROUP record applied: older ones (a replay) are skipped
        self.applied_seq = 0
        # state() as last built, and the (version, applied_seq) it was built at
        self._state: dict | None = None
        self._state_at: tuple[int, int] | None = None

    # --- changes ------------------------------------------------------------------------------
    def create(self, subject: str, name: str, at_ms: int, since: int | None = None) -> tuple[Group, bool]:
        """The group, and whether it was created now (False: it existed)."""
        groups = self._by_subject.setdefault(subject, {})
        g = groups.get(name)
        if g is not None:
            return g, False
        if since is None:
            since = at_ms if groups else self._kept_since.pop(subject, BEGINNING)
        else:
            self._kept_since.pop(subject, None)
        g = Group(self._next_gid, subject, name, since, at_ms, group_bytes(name))
        self._next_gid += 1
        groups[name] = g
        self._by_gid[g.gid] = g
        self._by_name.setdefault(name, {})[subject] = g
        self.version += 1
        return g, True

    def delete(self, subject: str, name: str, at_ms: int) -> Group | None:
        groups = self._by_subject.get(subject)
        g = groups.pop(name, None) if groups else None
        if g is None:
            return None
        del self._by_gid[g.gid]
        named = self._by_name[name]
        del named[subject]
        if not named:
            del self._by_name[name]
        if not groups:
            del self._by_subject[subject]
            self._kept_since[subject] = at_ms
        self.version += 1
        return g

    # --- lookups --------------------------------------------------------------------------------
    def of_subject(self, subject: str) -> list[Group]:
        return list(self._by_subject.get(subject, {}).values())

    def get(self, subject: str, name: str) -> Group | None:
        return self._by_subject.get(subject, {}).get(name)

    def kept_since(self, subject: str) -> int:
        """From when a subject with no group keeps its due messages for its next first
        group (that group's ``since``): when its last group was deleted, else always."""
        return self._kept_since.get(subject, BEGINNING)

    def by_gid(self, gid: int) -> Group | None:
        return self._by_gid.get(gid)

    def all(self) -> list[Group]:
        return sorted(self._by_gid.values(), key=lambda g: (g.subject, g.name))

    def listed(self) -> list[Group]:
        """Every group, in no particular order (``all()`` without its sort)."""
        return list(self._by_gid.values())

    def select(self, subject: str | None = None, name: str | None = None) -> list[Group]:
        """The groups of ``subject``, named ``name``, or both (None: any), in ``all()``'s
        order; found through an index, so a narrow question costs its answer only."""
        if subject is not None and name is not None:
            g = self.get(subject, name)
            return [] if g is None else [g]
        if subject is not None:
            return sorted(self._by_subject.get(subject, {}).values(), key=lambda g: g.name)
        if name is not None:
            return sorted(self._by_name.get(name, {}).values(), key=lambda g: g.subject)
        return self.all()

    def __len__(self) -> int:
        return len(self._by_gid)

    # --- persistence (saved with the iterate checkpoint) -------------------------------------------
    def state(self) -> dict:
        """The table as the iterate checkpoint saves it. Built again only after a change:
        the checkpoint asks for it every 0.2 s while records pass, under the scheduler's
        lock, and building it sorts every group (3 ms at 5,000 groups, the dispatcher
        waiting meanwhile). Treat the lists as read-only."""
        at = (self.version, self.applied_seq)
        if self._state is None or self._state_at != at:
            self._state = {
                "groups": [[g.subject, g.name, g.since, g.created_ms] for g in self.all()],
                "groups_kept_since": sorted([s, t] for s, t in self._kept_since.items()),
                "groups_seq": self.applied_seq,
            }
            self._state_at = at
        return dict(self._state)

    @classmethod
    def from_state(cls, state: dict) -> GroupTable:
        """The table a checkpoint saved; a data folder written before groups existed has
        none (its subjects' first groups inherit what was kept for them)."""
        t = cls()
        for subject, name, since, created in state.get("groups", ()):
            t.create(str(subject), str(name), int(created), since=int(since))
        for subject, at in state.get("groups_kept_since", ()):
            if str(subject) not in t._by_subject:
                t._kept_since[str(subject)] = int(at)
        t.applied_seq = int(state.get("groups_seq", 0))
        return t


__all__ = ["BEGINNING", "DEFAULT_GROUP", "Group", "GroupTable"]
