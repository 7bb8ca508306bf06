"""Unit tests of raying.sampling."""
