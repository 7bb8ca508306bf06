"""Unit tests of raying.tools."""
