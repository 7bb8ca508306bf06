"""Unit tests of raying.loader."""
