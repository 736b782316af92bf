"""Serving over HTTP: the OpenAI-compatible routes, their typed request bodies, Prometheus metrics.

Needs the `server` extra; without it importing any of these modules is one `MissingExtra` naming it.
"""

from tokenflow.extras import check_installed

check_installed("server", "tokenflow.serve (the OpenAI-compatible HTTP app)", "starlette", "prometheus_client")
