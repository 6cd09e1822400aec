"""KV cache tiers under the radix cache: host memory and local disk (issue 43).

``block_hash`` keys a block by what it holds; ``block_format`` is a block at rest (checksummed,
sealed for an encrypted model); ``disk_tier`` keeps blocks in files that outlive the process (and
that replicas share); ``remote_tier`` in a Valkey / Redis server replicas share; ``tier_stack`` puts
the two side by side; ``store`` is the two tiers together, shared by the scheduler's side (which blocks exist)
and the driver worker (which copies them in and out of the KV cache); ``link`` is the KV cache
manager's side: what to save when the radix tree lets a block go, what to load on a prefix hit.
"""
