"""Prefect flows: orchestration only — every stage runs through DVC, whose cache decides what is up to date."""
