"""Pipeline stages: one thin module per DVC stage (``python -m stages.<name>``) that reads its params section and
calls one `detpipe` function; the work lives in `detpipe`, which never imports this package."""
