"""Which open pipeline each of raying's stateful samplers belongs to."""

from __future__ import annotations

import weakref
from typing import Any

from raying.errors import ConfigError

# The open pipeline each of raying's stateful samplers belongs to, by the sampler's id, both
# held weakly. Such a sampler binds to one dataset and pipeline (a weighted one's class
# weights and set-aside samples, a prioritized or InfoBatch one's priority store): a second
# pipeline given the same object would rebind it under the first one, which would go on
# drawing from the other dataset's weights or a store it no longer reports to.
_SAMPLER_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def claim_sampler(pipe: Any) -> None:
    """Make ``pipe`` the owner of its sampler, or raise ConfigError if another open, bound
    pipeline (not one of its ``map_batches`` copies, which share its name) owns it."""
    from raying.sampling.infobatch import InfoBatchSampler
    from raying.sampling.prioritized import PrioritizedSampler
    from raying.sampling.weighted import WeightedSampler

    sampler = pipe.sampler
    if not isinstance(sampler, (WeightedSampler, PrioritizedSampler, InfoBatchSampler)):
        return  # UniformSampler plans from (seed, epoch) and the manifest alone: shareable
    for key, (sref, pref) in list(_SAMPLER_OWNERS.items()):
        if sref() is None or pref() is None:
            del _SAMPLER_OWNERS[key]
    entry = _SAMPLER_OWNERS.get(id(sampler))
    owner = entry[1]() if entry is not None and entry[0]() is sampler else None
    if (owner is not None and owner is not pipe and owner.name != pipe.name and owner._bound
            and not owner._closed and not owner._session_ended()):
        msg = (f"this {type(sampler).__name__} belongs to Pipeline {owner.name!r}, which is "
               f"open: a sampler holds one pipeline's dataset weights, set-aside samples or "
               f"priority store; give this Pipeline a sampler of its own (the same arguments "
               f"make the same plans), or close {owner.name!r} first")
        raise ConfigError(msg)
    if owner is None or not owner._bound or owner.name != pipe.name:
        _SAMPLER_OWNERS[id(sampler)] = (weakref.ref(sampler), weakref.ref(pipe))
