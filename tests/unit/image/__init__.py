"""Unit tests of raying.image."""
