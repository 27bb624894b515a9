"""Training: the loop, optimizer and schedule, loss, metrics."""
