"""Offline target features: capture them once (``capture.py``) into safetensors shards (``store.py``,
encoded by ``codec.py``), then train from the cache without the target body."""
