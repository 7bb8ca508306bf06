"""raying: a Ray Data loader for deep-learning training that learns which samples matter."""
