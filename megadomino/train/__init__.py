"""The training loop and what it drives each iteration: the step, the log line, early stops, the
LR schedule, timers and metrics, profiling, and checkpoints (`checkpoint/`)."""
