"""Unit tests of raying.storage."""
