"""Pipeline stages: one module per DVC stage (``python -m stages.<name>``) plus small shared modules."""
