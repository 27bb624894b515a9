"""Jobs: what runs on top of the stages: the `train`, `tasks`, `start`, `generate`, `launch` and `run` commands
(notebooks executed headless with papermill), several layouts in one launch, the LR sweep, run-directory reports."""
