"""Between storage and decode: read planning, caching tiers and the slow-storage simulator."""
