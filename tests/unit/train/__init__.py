"""Unit tests of raying.train."""
