"""Unit tests of raying.dataset."""
