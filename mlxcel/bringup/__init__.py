"""Zero-config bring-up: ``--pp-auto N`` / ``--pp-peer`` (docs/bringup.md).

Module map (the protocol core is sans-I/O, like the cluster handshake):

- ``wire``         flags' defaults, bounds and wire constants (one source of truth)
- ``errors``       one exception base; refusals, failed bring-ups, protocol errors
- ``messages``     assignment protocol v2 messages: kinds, fields, strict JSON codec
- ``machine``      sans-I/O state machines: ``PeerMachine``, ``CoordinatorSession``, ``judge_offer``
- ``channel``      the assignment channel over a blocking socket (handshake, one frame per message)
- ``beacon``       signed UDP beacons: pure encode/verify, sender and listener
- ``plan``         stage plan (address order, ``plan_stages``) and the generated cluster TOML
- ``flags``        the bring-up flags, checked and resolved
- ``push``         the coordinator's side: reach, plan, offer, commit, activate, abort
- ``agent``        the peer's side: assignment listener, sessions, beacons, the wait
(the roles ``pp-auto`` and ``pp-peer`` are ``mlxcel/entrypoints/pp_auto.py`` and ``pp_peer.py``)
"""
