"""Commands on top of the library: the CLI, ``raying pack``, local clusters, ``raying
advise``, the demo and generated data."""
