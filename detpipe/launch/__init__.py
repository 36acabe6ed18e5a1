"""Launching workers, from outside them: the train stage's launch (`jobs`), torchrun's agent and its arguments
(`torchrun`), Slurm, Kubernetes. What runs inside a worker is `detpipe.engine`, which this package never imports."""
