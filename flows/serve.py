"""Serve the ``train`` flow as deployment ``train/main`` (``python -m flows.serve``), against the Prefect API
given by ``PREFECT_API_URL`` (e.g. a local ``prefect server start --host 127.0.0.1``)."""
from flows.train import train

if __name__ == "__main__":
    train.serve(name="main")
