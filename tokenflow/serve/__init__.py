"""Serving over HTTP: the OpenAI-compatible routes, their typed request bodies, Prometheus metrics."""
