"""Pictures: boxes, masks and labels drawn on images (`drawing`, with the one PNG encoder), the train stage's batch
grid (`batch_plot`). Imports only `detpipe.core` (tests/unit/test_layering.py)."""
