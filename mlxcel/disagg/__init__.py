"""Disaggregated inference: prefill, decode and router roles with a KV-cache handoff (docs/disagg.md).

Module map (the codecs are sans-I/O; the services own sockets and threads):

- ``wire``        constants: message types, KV handoff parts, bounds, defaults, environment variables
- ``kv_codec``    the KV handoff wire format: header, raw tensor chunks, end; ``HandoffDecoder`` with its bounds
- ``kv_send``     the sender's CHUNK and END parts: views of the tensors' memory (``kv_codec`` re-exports them)
- ``kv_split``    a handoff split over several part streams: SPLIT and PART records, byte ranges, ``SplitAssembly``
- ``kv_cache``    mlx-lm caches <-> handoff tensors; ``probe_layout`` (which caches a model keeps)
- ``kv_records_generic``  record kind STATE: allow-listed mlx-lm cache classes by the state contract
- ``kv_records_dsv41``    record kind DSV41: deepseek_v41's ``LayerCache``, rebuilt with the decode node's window
- ``messages``    control messages (GENERATE, CANCEL, TOKENS, FINISH, ERROR, HANDED_OFF, STATE), strictly checked
- ``allowlist``   ``MLXCEL_DECODE_ALLOWLIST``: where a prefill node may send a KV cache
- ``lanes``       which of a prefill node's connections to a decode node the next handoff takes (``MLXCEL_HANDOFF_LANES``), when to split one
- ``split_intake``  the decode node joining part streams to their header stream (``DecodeService`` mixes it in)
- ``intake``      handoff parts fed to their decoders beside the reader threads (``MLXCEL_HANDOFF_INTAKE_WORKERS``)
- ``host_staging``  page-locked host buffers a handoff is copied through by DMA on CUDA (``MLXCEL_HANDOFF_STAGING``)
- ``flags``       ``--node-role``, ``--serving-bind``, ``--prefill-peers``, ``--decode-peers``, TOML roles -> ``NodeConfig``
- ``service``     what prefill and decode share: the role transport, STATE answers, sends to a router
- ``prefill``     ``PrefillService``: GENERATE -> checks -> prefill -> KV handoff stream -> HANDED_OFF
- ``decode``      ``DecodeService``: handoff streams -> ``submit_prefilled`` -> TOKENS/FINISH to the router
- ``router_engine``  ``RouterEngine``: the OpenAI API's engine, round-robin over healthy nodes, failover, demux
- ``routed``      the router's records: ``NodeInfo`` (a configured node) and ``Routed`` (a client request and its attempt)
- ``waiting``     the router's requests waiting for nodes: new ones held (``holding``: their bookkeeping), failed ones resumed
- ``late_handoffs``  which prefill node's HANDED_OFF the router still counts after its attempt ended
- ``policy``      ``RoutePolicy``: the router's pick (round-robin over nodes up) and retry decisions, over plain data
- ``loop``        an asyncio loop on a thread (the scheduler's event streams need one)
  (the roles are ``mlxcel/entrypoints/prefill.py``, ``decode.py`` and ``router.py``; a prefill or decode
  process's shell, the model loading while /health says how it goes, is ``mlxcel/entrypoints/disagg_node.py``)
"""
