"""Serving engines run outside this package's interpreter: vLLM (``serving.launch``, which runs
``vllm_runner.py``; no module here is named vllm, so the runner's own folder never shadows vLLM) and
OpenAI-compatible servers (``serving.engines``)."""
