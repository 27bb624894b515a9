"""The engine: the loop, optimizer and schedule, metrics. It names no stage: canntrain_core/stages/ maps each
``train_mode`` to its trainer."""
