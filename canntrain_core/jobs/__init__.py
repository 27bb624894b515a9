"""Jobs: notebooks executed headless with papermill, and run-directory reports."""
