"""Unit tests of raying.engine."""
