"""The samples a sampler leaves out of its plans because they could not be read."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

# Epochs whose left-out sets are kept (and saved): those planned most recently. The epoch
# being read and the next one (planned early) are two; the rest leaves room for plans asked
# for besides (``pipe.plan(e)``, ``pipe.dataset(e)``) without losing the epoch being read.
PLANS_KEPT = 8


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
        # Plans are drawn on the pipeline's reader thread (the next epoch's, early) while the
        # training thread may take a state.
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"ids": self.ids, "_at": dict(self._at)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()
        self.ids, self._at = state["ids"], state["_at"]

    def add(self, ids: Any) -> None:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        with self._lock:
            self.ids = np.union1d(self.ids, ids)

    def for_plan(self, epoch: int) -> np.ndarray:
        """The ids ``epoch``'s plan leaves out: those set aside when it was first planned."""
        epoch = int(epoch)
        with self._lock:
            left_out = self._at.pop(epoch, None)
            if left_out is None:
                left_out = self.ids.copy()
            self._at[epoch] = left_out  # the most recently planned last
            for old in list(self._at)[:-PLANS_KEPT]:
                del self._at[old]
        return left_out

    def state(self) -> dict[str, Any]:
        with self._lock:
            # Lists and string keys: a state JSON can carry (load takes either form).
            return {"set_aside": self.ids.tolist(),
                    "plan_set_aside": {str(e): a.tolist() for e, a in self._at.items()}}

    def load(self, state: dict[str, Any]) -> None:
        """From :meth:`state` (a state without per-epoch sets leaves every plan the whole
        set out)."""
        ids = np.asarray(state.get("set_aside", []), dtype=np.int64).reshape(-1)
        at = {int(e): np.asarray(a, dtype=np.int64).reshape(-1)
              for e, a in (state.get("plan_set_aside") or {}).items()}
        with self._lock:
            self.ids, self._at = ids, at
