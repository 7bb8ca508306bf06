"""Progress bars for long commands (tqdm on stderr; silent when disabled)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass


@contextlib.contextmanager
def progress_bar(*, total: int | None, desc: str, unit: str = "it",
                 enabled: bool = True) -> Iterator[Any]:
    """A tqdm bar on stderr, or an object with the same update() that prints nothing."""
    if not enabled:
        yield _Silent()
        return
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True,
               mininterval=0.5, leave=True)
    try:
        yield bar
    finally:
        bar.close()
