"""Rollout engines beside the trainer: vLLM in a process and environment of its own (``vllm_engine.py`` drives
``vllm_server.py``)."""
