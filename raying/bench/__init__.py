"""`raying bench` and the micro-benchmarks: raying against the loaders users already have."""
