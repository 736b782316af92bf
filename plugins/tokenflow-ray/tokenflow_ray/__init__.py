"""tokenflow on Ray Serve: N engine replicas, prefix-affinity routing, an OpenAI-style HTTP ingress.

    from ray import serve
    from tokenflow_ray import build_app

    serve.run(build_app("smollm2-135m", num_replicas=2))   # POST /v1/completions, /v1/chat/completions
"""

from tokenflow_ray.app import EngineServer, HTTPIngress, build_app
from tokenflow_ray.routing import PrefixAffinityRouter, rank_replicas, replica_order, routing_key

__all__ = ("EngineServer", "HTTPIngress", "PrefixAffinityRouter", "build_app", "rank_replicas", "replica_order",
           "routing_key")
