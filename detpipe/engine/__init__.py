"""Training: the loop and `HookBase` (`train_loop`), hooks, checkpoints, and the detection trainer."""
