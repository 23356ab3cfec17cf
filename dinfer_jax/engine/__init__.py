"""Serving engine: paged/ring caches, scheduler, jitted model steps, the asynchronous host loop and ``LLM``."""
