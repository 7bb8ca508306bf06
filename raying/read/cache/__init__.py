"""The bytes cache: size-bounded memory and disk tiers shared by a node's processes (SQLite
index, checksummed entries, single flight), ranked by the sampler's priorities."""
