"""Analyzers: pure functions from the store to findings."""
