"""Unit tests of raying.bench."""
