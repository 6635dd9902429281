"""Disaggregated inference: prefill, decode and router roles with a KV-cache handoff (docs/disaggregated.md).

Module map (the codecs are sans-I/O; the services own sockets and threads):

- ``wire``        constants: message types, KV handoff parts, bounds, defaults, environment variables
- ``kv_codec``    the KV handoff wire format: header, raw tensor chunks, end; ``HandoffDecoder`` with its bounds
- ``kv_cache``    mlx-lm caches <-> handoff tensors; ``probe_layout`` (which caches a model keeps)
"""
