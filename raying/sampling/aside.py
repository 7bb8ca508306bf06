"""The samples a sampler leaves out of its plans because they could not be read."""

from __future__ import annotations

from typing import Any

import numpy as np

# Epochs whose left-out sets are kept (and saved): the two planned most recently (the epoch
# being read, and the next one when it is planned early).
PLANS_KEPT = 2


class SetAside:
    """Ids that failed to read or decode, left out of later plans.

    Each epoch's plan is drawn with the set as it stood when the epoch was first planned,
    and keeps it: the epoch planned again (a resume from a state taken mid-epoch, after
    more samples were set aside further on in it; a rewind) gets the very same plan. The
    state carries those per-epoch sets for the last ``PLANS_KEPT`` epochs planned.
    """

    def __init__(self) -> None:
        self.ids = np.zeros(0, dtype=np.int64)
        self._at: dict[int, np.ndarray] = {}

    def add(self, ids: Any) -> None:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        self.ids = np.union1d(self.ids, ids)

    def for_plan(self, epoch: int) -> np.ndarray:
        """The ids ``epoch``'s plan leaves out: those set aside when it was first planned."""
        epoch = int(epoch)
        left_out = self._at.pop(epoch, None)
        if left_out is None:
            left_out = self.ids.copy()
        self._at[epoch] = left_out  # the most recently planned last
        for old in list(self._at)[:-PLANS_KEPT]:
            del self._at[old]
        return left_out

    def state(self) -> dict[str, Any]:
        return {"set_aside": self.ids.copy(),
                "plan_set_aside": {e: a.copy() for e, a in self._at.items()}}

    def load(self, state: dict[str, Any]) -> None:
        """From :meth:`state` (a state without per-epoch sets leaves every plan the whole
        set out)."""
        self.ids = np.asarray(state.get("set_aside", []), dtype=np.int64).reshape(-1)
        self._at = {int(e): np.asarray(a, dtype=np.int64).reshape(-1)
                    for e, a in (state.get("plan_set_aside") or {}).items()}
