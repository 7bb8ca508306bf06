"""Whether a process of this node is still running (used by owner files and claims)."""

from __future__ import annotations

import contextlib
import os


def alive(pid: int) -> bool:
    """True while process ``pid`` runs: not gone, and not a zombie (exited, not reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    return True
