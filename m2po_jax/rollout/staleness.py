"""Admission control for asynchronous rollouts: no trained sample older than k versions.

AReaL's rule (`areal/infra/staleness_manager.py`): with the learner at policy version v,
staleness bound k and B prompts consumed per update, a new rollout may start only while

    (v + k + 1) * B >= accepted + running + (the new rollout's prompts)

`accepted` counts every prompt whose rollout finished and entered the buffer over the
whole run (it is not decremented when the learner consumes it), `running` those being
generated. The learner at version v has consumed v * B prompts, so a batch admitted under
version v is trained at version <= v + k: the bound holds by construction, not by
dropping data. Counts are in prompts (a prompt's `n_samples` completions travel together).

After a resume the counters must restart from the restored version, with `accepted` =
the prompts consumed by the restored updates plus the buffered ones
(`Admission.restored`): starting them at zero with the version restored is AReaL's issue
1388, where staleness ran far past the bound after recovery.
"""

from __future__ import annotations

import dataclasses
import threading


def capacity(version: int, max_staleness: int, batch_size: int, accepted: int, running: int) -> int:
    """Prompts that may still start under AReaL's staleness rule (negative: over)."""
    return (version + max_staleness + 1) * batch_size - (accepted + running)


def may_start(
    version: int, max_staleness: int, batch_size: int, accepted: int, running: int, prompts: int
) -> bool:
    """Whether a rollout of `prompts` prompts may start with the learner at `version`."""
    return capacity(version, max_staleness, batch_size, accepted, running) >= prompts


@dataclasses.dataclass
class Counts:
    """Prompts accepted (ever), running now, and discarded (ever, by reason)."""

    accepted: int = 0
    running: int = 0
    discarded: dict[str, int] = dataclasses.field(default_factory=dict)


class Admission:
    """Thread-safe counters behind `may_start`, shared by the rollout worker and the learner.

    Args:
      max_staleness: k, `rollout.max_head_offpolicyness`.
      batch_size: prompts the learner consumes per update (`rollout.batch_size`).
      accepted: prompts accepted before (a resume: `restored`).
    """

    def __init__(self, max_staleness: int, batch_size: int, accepted: int = 0):
        if max_staleness < 0 or batch_size < 1 or accepted < 0:
            raise ValueError(
                f"Admission: max_staleness={max_staleness} (>= 0), batch_size={batch_size} "
                f"(>= 1), accepted={accepted} (>= 0)"
            )
        self.max_staleness = max_staleness
        self.batch_size = batch_size
        self._counts = Counts(accepted=accepted)
        self._lock = threading.Lock()

    @classmethod
    def restored(cls, max_staleness: int, batch_size: int, version: int, buffered: int):
        """Counters of a run resumed at `version` with `buffered` prompts in its buffer."""
        return cls(max_staleness, batch_size, accepted=version * batch_size + buffered)

    def try_start(self, version: int, prompts: int) -> bool:
        """Counts `prompts` as running if the rule admits them now; False if it does not."""
        with self._lock:
            c = self._counts
            if not may_start(
                version, self.max_staleness, self.batch_size, c.accepted, c.running, prompts
            ):
                return False
            c.running += prompts
            return True

    def accept(self, prompts: int) -> None:
        """A running rollout of `prompts` prompts finished and entered the buffer."""
        with self._lock:
            self._finish(prompts)
            self._counts.accepted += prompts

    def discard(self, prompts: int, reason: str) -> None:
        """A running rollout ended without entering the buffer (counted under `reason`)."""
        with self._lock:
            self._finish(prompts)
            d = self._counts.discarded
            d[reason] = d.get(reason, 0) + prompts

    def _finish(self, prompts: int) -> None:
        if prompts > self._counts.running:
            raise RuntimeError(
                f"Admission: {prompts} prompts finished but only {self._counts.running} run"
            )
        self._counts.running -= prompts

    def counts(self) -> Counts:
        """A snapshot of the counters."""
        with self._lock:
            c = self._counts
            return Counts(c.accepted, c.running, dict(c.discarded))
