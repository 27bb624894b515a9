"""EleutherAI's lm-evaluation-harness over canntrain's model: the harness's ``LM`` interface (``harness_lm.py``),
canntrain's verifiable tasks as harness tasks (``harness_tasks.py``) and one quiet run of a task list
(``harness_run.py``). ``canntrain eval`` (jobs/harness.py) runs them on a saved model, the trainer on its live one
(``logging.eval_tasks``). The harness is an optional dependency (the eval extra): nothing here is imported unless a
task is named."""
