"""What hkvd tells routers about the prefixes it holds.

- KV events (``kv_events``, ``announcer``, ``zmq_publisher``): vLLM-format ``BlockStored`` /
  ``BlockRemoved`` events for the chunks this node stores and drops.
- Usable-prefix lookups (``usable_prefix``): on the metrics port, the longest prefix of a prompt
  each tier can serve under the hybrid hit rule, for a model and format this daemon has seen.
"""
