"""Unit tests of raying.read."""
