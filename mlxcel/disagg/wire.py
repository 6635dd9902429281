"""Wire constants and defaults of disaggregated inference: one home (``docs/disagg.md``).

No MLX and no I/O: the sans-I/O codecs, the services and the docs tests import these.
"""

from __future__ import annotations

import enum

# --- KV handoff (prefill -> decode, one transport stream; docs/disagg.md §4) --------------

KV_MAGIC = b"MXKV"
KV_VERSION = 1
#: largest JSON request document inside a handoff header: 16 KiB, and room for a grammar (64 KiB of text, each
#: byte at most 6 once JSON-escaped)
MAX_KV_META_LEN = 16 * 1024 + 6 * 64 * 1024
#: largest tensor-byte payload of one CHUNK part (the sender uses KV_CHUNK_LEN)
MAX_KV_CHUNK_LEN = 4 * 1024 * 1024
KV_CHUNK_LEN = 1024 * 1024
#: a split handoff (docs/disagg.md §4.9) has 2..MAX_KV_SPLIT part streams
MAX_KV_SPLIT = 16
#: a prefill node splits a handoff of at least this many tensor bytes over its lanes
#: (MLXCEL_HANDOFF_SPLIT_MIN_BYTES overrides)
DEFAULT_SPLIT_MIN_BYTES = 16 * 1024 * 1024
#: tensor bytes a decode node keeps of part streams whose header stream has not arrived yet, per handoff
MAX_KV_EARLY_BYTES = 16 * 1024 * 1024


class Part(enum.IntEnum):
    """First byte of every STREAM_DATA body of a handoff stream."""

    HEADER = 0x01
    CHUNK = 0x02
    END = 0x03
    SPLIT = 0x04  # header stream of a split handoff: its tensor bytes come on N part streams
    PART = 0x05  # first part of a part stream: the header stream it belongs to, its index and N


class CacheKind(enum.IntEnum):
    """The first byte of a layer record: how one layer's cache is held (mlx-lm's cache classes)."""

    KV = 1  # KVCache: every position (MLA's latent cache too: one head, latent and rope widths)
    ROTATING = 2  # RotatingKVCache: the last max_size positions (sliding-window layers)
    QUANTIZED = 3  # QuantizedKVCache: packed uint32 + scales + biases per keys and values
    ARRAYS = 4  # ArraysCache: fixed-shape state arrays (linear attention, SSM); ARRAY records follow
    LIST = 5  # CacheList: several caches for one layer; their records follow
    ARRAY = 6  # not a layer: one array of the ARRAYS record before it (dtype and shape)
    CHUNKED = 7  # ChunkedKVCache (llama4's chunked attention): the last min(tokens, chunk size) positions
    STATE = 8  # an allow-listed cache class by mlx-lm's state contract (kv_records_generic); ARRAY records follow
    DSV41 = 9  # deepseek_v41's LayerCache: window, compressed rows, index keys, open group (kv_records_dsv41)


#: most arrays in one ARRAYS layer, most caches in one LIST layer, most dimensions of one array
MAX_KV_ARRAYS = 8
MAX_KV_LIST = 8
MAX_KV_NDIM = 5


class DType(enum.IntEnum):
    """Element types on the wire (little-endian; bfloat16 as its raw 16 bits)."""

    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3
    UINT32 = 4
    INT64 = 5  # an ARRAY's only (longcat_flash_ngram's n-gram token ids): never a layer record's dtype


DTYPE_NAMES = {DType.FLOAT32: "float32", DType.FLOAT16: "float16", DType.BFLOAT16: "bfloat16", DType.UINT32: "uint32",
               DType.INT64: "int64"}
DTYPE_SIZES = {DType.FLOAT32: 4, DType.FLOAT16: 2, DType.BFLOAT16: 2, DType.UINT32: 4, DType.INT64: 8}

# --- control messages (router <-> prefill/decode; docs/disagg.md §3) ----------------------


class MsgType(enum.IntEnum):
    """First byte of a disaggregated CONTROL message or RPC body; a JSON object follows."""

    GENERATE = 0x01  # router -> prefill
    CANCEL = 0x02  # router -> prefill, decode
    TOKENS = 0x03  # decode -> router
    FINISH = 0x04  # decode -> router
    ERROR = 0x05  # prefill or decode -> router
    HANDED_OFF = 0x06  # prefill -> router
    STATE = 0x07  # RPC request (router probe) and its reply
    PROGRESS = 0x08  # prefill or decode -> router: still working on it (a long prefill, a queue)


#: largest JSON document of a control message (a GENERATE holds the prompt's token ids)
MAX_CONTROL_LEN = 4 * 1024 * 1024
#: most TOKENS events one message carries
MAX_EVENTS_PER_MESSAGE = 256
NONCE_HEX_LEN = 16

# --- roles, flags and defaults -------------------------------------------------------------------

# the role names (--node-role's choices among them) are written once, in mlxcel/topology/names.py
ALLOWLIST_ENV = "MLXCEL_DECODE_ALLOWLIST"
# the other environment variables of these roles are read once, in mlxcel/envs.py
#: router: a request fails when no handoff result (first token or error) arrives this long after dispatch,
#: and when a decode node stays silent this long between two messages
DEFAULT_HANDOFF_TIMEOUT_S = 30.0
#: prefill and decode nodes send PROGRESS for every request they hold at this period while no other
#: message of it went to the router; --handoff-timeout must be at least MIN_HANDOFF_TIMEOUT_S
PROGRESS_INTERVAL_S = 2.0
MIN_HANDOFF_TIMEOUT_S = 5.0
#: router: liveness probe period of every prefill and decode node
DEFAULT_PROBE_INTERVAL_S = 1.0
#: a node that does not answer a probe within this long is down
PROBE_TIMEOUT_S = 2.0
#: router: attempts of one request over different nodes before it fails (a dead node is skipped)
MAX_DISPATCH_ATTEMPTS = 3
#: decode: a CANCEL for a handoff not yet seen is remembered this long
CANCEL_MEMORY_S = 60.0
#: dial policy of the role transports: one retry, no time budget, so a dead peer is known in ~0.1 s
DIAL_RETRIES = 1
