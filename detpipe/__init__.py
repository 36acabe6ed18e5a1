"""detpipe: the library behind the pipeline stages (one module per concern)."""
