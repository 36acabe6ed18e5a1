"""Launching workers: distributed setup inside a worker, torchrun arguments, elastic plan, Slurm, Kubernetes."""
