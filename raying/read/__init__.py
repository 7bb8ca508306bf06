"""The read task: what one task does with one unit of the plan (fetch bytes, decode, augment,
account), the read planner, the bytes cache in front of slow storage and the decoded-pixel
cache. Imports ``storage``, ``image``, ``dataset`` and ``sampling.plan``; never Ray at module
level."""
