"""`pagoda router`: one OpenAI-compatible endpoint in front of several `pagoda serve` replicas.

The modules, each one concept (docs/architecture.md, "The router"):

- `hash_ring`: consistent hashing with virtual nodes (sessions stay put when workers come and go)
- `prefix_tree`: which prompt prefixes each worker has seen (for cache-aware routing)
- `affinity`: a request's session key and prompt text
- `policies`: round_robin, least_load, consistent_hash, cache_aware
- `workers`: the worker registry, health probes, circuit breakers, warm-up
- `limits`: the gateway's token buckets and in-flight bound (429 + Retry-After)
- `prometheus`: the router's Prometheus metrics
- `proxy`: headers, error bodies, the SSE relay
- `app`: the Starlette app and the forwarding (retry once, stream errors)
- `options`: the command line (imports nothing heavy, for `pagoda --help`)

Importing this package imports none of them.
"""

POLICIES = ("cache_aware", "consistent_hash", "least_load", "round_robin")
