"""Constants of the zero-config bring-up: flags' defaults, bounds, wire values (docs/bringup.md).

One source of truth for the flags (``mlxcel/bringup/flags.py``), the beacon and assignment code
and the docs. No I/O and no MLX here.
"""

from __future__ import annotations

import re

from mlxcel.cluster.wire import HANDSHAKE_TIMEOUT_S  # noqa: F401 - the cluster handshake's own bound (5 s)
from mlxcel.config import DEFAULT_CLUSTER_NAME  # noqa: F401 - re-exported: the --cluster-name default

# --- flags' defaults ----------------------------------------------------------------------

#: the coordinator's control address is the --host IP on this port unless --cluster-control-addr says otherwise
DEFAULT_CONTROL_PORT = 19000
DEFAULT_DISCOVERY = "static"
DISCOVERY_MODES = ("static", "mdns")
#: the limited broadcast; tests and rehearsals on one machine pass 127.0.0.1
DEFAULT_DISCOVERY_TARGET = "255.255.255.255"
DEFAULT_DISCOVERY_PORT = 49555
DEFAULT_COORDINATOR_CONFIG_OUT = ".mlxcel/cluster.toml"
#: ``{node_id}`` is replaced by the node id the peer was assigned
DEFAULT_PEER_CONFIG_OUT = ".mlxcel/cluster-{node_id}.toml"
COORDINATOR_NODE_ID = "coordinator"
#: --pp-spare: standby peers a --pp-auto coordinator keeps for stages that stay down (0: none)
DEFAULT_SPARES = 0
MAX_SPARES = 16
#: --pp-spare-after: a stage down this long (seconds) is assigned to a spare
DEFAULT_SPARE_AFTER_S = 5.0
MAX_SPARE_AFTER_S = 3600.0
#: a cluster name travels in beacons and offers and is written into TOML: a safe, short charset
CLUSTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

# --- bounds (seconds) ---------------------------------------------------------------------

FRAME_TIMEOUT_S = 10.0  # waiting for one assignment frame
PUSH_WINDOW_S = 60.0  # the coordinator's whole push, from the end of discovery
OFFER_MARGIN_S = 10.0  # the offer phase ends this long before the push window
COMMIT_WAIT_S = 60.0  # a peer's wait between Accepted and Commit
ACTIVATE_WAIT_S = 60.0  # a peer's wait between Committed and Activate
ASSIGNMENT_WAIT_S = 600.0  # a peer's wait for any assignment
#: a spare's takeover push (reach and offer end OFFER_MARGIN_S before it): a standby that does not answer
#: within 10 s is skipped for the next one
SPARE_PUSH_WINDOW_S = 20.0
SPARE_CHECK_S = 10.0  # the coordinator checks that each spare still answers this often
#: while a stage is down the coordinator dials its address this often, once, to re-assign a restarted peer
REASSIGN_CHECK_S = 1.0
#: a restarted peer that failed its re-assignment (another secret, checkpoint, version, a refusal) is
#: dialled again only this long afterwards
REASSIGN_BACKOFF_S = 30.0
STATIC_RETRY_S = 0.5  # the coordinator redials an unreachable static peer this often
DISCOVERY_WINDOW_S = 30.0  # the coordinator listens for beacons this long
BEACON_INTERVAL_S = 1.0  # a peer beacons this often until its assignment is committed
BEACON_MAX_SKEW_S = 60.0  # a beacon this far off the coordinator's clock is stale; also the replay window
#: after the N-th peer was discovered the coordinator keeps listening this long, so that an
#: (N+1)-th peer beaconing at the same time is seen and the choice is not left to timing
DISCOVERY_SETTLE_S = 1.5

# --- assignment protocol --------------------------------------------------------------------

ASSIGNMENT_PROTOCOL_VERSION = 2
#: an assignment message (one CONTROL frame, a JSON object) is at most this long
MAX_ASSIGNMENT_MESSAGE = 64 * 1024
MAX_REASON_LEN = 1024  # characters of a refusal, commit failure or abort reason
MAX_STAGES = 256

# --- beacons --------------------------------------------------------------------------------

BEACON_MAGIC = b"MLXB"
BEACON_FORMAT_VERSION = 1
BEACON_LABEL = b"mlxcel-beacon-v1\x00"
BEACON_NONCE_LEN = 16
BEACON_MAC_LEN = 32
MAX_BEACON_LEN = 512
#: beacon nonces kept for replay detection (entries older than the skew window are dropped first)
MAX_REPLAY_ENTRIES = 4096
