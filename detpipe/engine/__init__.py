"""Training, inside each worker: the loop and `HookBase` (`train_loop`), hooks, checkpoints, the detection trainer,
distributed setup (`distributed`) and the elastic epoch plan (`elastic`). Launching the workers is `detpipe.launch`,
which this package never imports."""
