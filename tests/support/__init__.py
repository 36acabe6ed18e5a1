"""Helpers for the test suite that are not fixtures (imported as ``support.*``: tests/ is on sys.path)."""
