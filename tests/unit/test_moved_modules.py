"""The flat layout's import paths still work for one release, with a DeprecationWarning."""

from __future__ import annotations

import importlib
import sys

import pytest

import raying


@pytest.mark.parametrize(("old", "new"), [("raying.datagen", "raying.tools.datagen"),
                                          ("raying.io.options", "raying.options"),
                                          ("raying.pipeline", "raying.loader.pipeline"),
                                          ("raying.keras", "raying.loader.keras")])
def test_an_old_path_warns_and_gives_the_new_module(old, new, monkeypatch):
    for name in (old, "raying.io"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def test_every_old_path_names_a_module_that_exists():
    for new in raying._MOVED.values():
        importlib.import_module(new)
