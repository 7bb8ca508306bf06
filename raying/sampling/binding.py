"""Binding a sampler to its pipeline's priority store: create it, or find it after a restart."""

from __future__ import annotations

from typing import Any

from raying.errors import ConfigError


def bind_store(name: str, n: int, *, table: Any, store: Any,
               prior: Any = None, wait: bool = True) -> tuple[Any, bool]:
    """The store named ``name`` for ``n`` ids: found if it runs (a restarted driver), else created.

    Args:
        name: the store's actor name.
        n: the dataset's size; a running store of another size is refused.
        table: the table settings (TableConfig or dict).
        store: the store settings (StoreConfig, dict or None).
        prior: static weights of the ids for a store created here (a found one keeps its own).
        wait: wait for a created store's start (see ``store.create_store``).

    Returns:
        ``(handle, created)``: created is True when this call started the store.
    """
    from raying.sampling import store as st

    try:
        handle = st.get_store(name)
    except ConfigError:
        return (st.create_store(name, n, table=table, config=store, prior=prior, wait=wait),
                True)
    if handle.n != n:
        msg = (f"a priority store named {name!r} exists with {handle.n} rows, but the dataset "
               f"has {n}; use another PipelineConfig(name=...)")
        raise ConfigError(msg)
    return handle, False
