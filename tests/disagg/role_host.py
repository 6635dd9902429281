"""One process hosting prefill or decode services of several checkpoints: ``python -m tests.disagg.role_host SPEC``.

``SPEC`` is a JSON file: ``{"role": "prefill"|"decode", "secret_file": PATH, "nodes": [{"model": DIR,
"bind": "IP:PORT", "decode_peers": ["IP:PORT", ...]}, ...]}``. Each node is built as the prefill or
decode role of ``mlxcel-server`` builds it (``mlxcel.disagg.worker``: the service over the loaded
checkpoint, its identity and context length) and served on its bind. It prints ``ready N`` once all
serve, and serves until its stdin closes. The family table uses it so that every family's prefill and
decode nodes run in two processes instead of two per family.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def serve(spec: dict) -> None:
    import mlxcel  # noqa: F401  (OpenBLAS first)
    from mlxcel.cluster.identity import PeerId
    from mlxcel.cluster.secret import load_secret
    from mlxcel.disagg.allowlist import Allowlist
    from mlxcel.disagg.decode import DecodeService
    from mlxcel.disagg.flags import NodeConfig
    from mlxcel.disagg.prefill import PrefillService
    from mlxcel.models.facts import context_length
    from mlxcel.models.identity import model_identity
    from mlxcel.models.loading import load_checkpoint

    secret = load_secret(spec["secret_file"], env={})
    role = spec["role"]
    services = []
    try:
        for node in spec["nodes"]:
            checkpoint = load_checkpoint(Path(node["model"]))
            cfg = NodeConfig(role, PeerId.parse(node["bind"]), (),
                             tuple(PeerId.parse(p) for p in node.get("decode_peers", ())), secret)
            sizes = dict(identity=model_identity(node["model"]), context_length=context_length(checkpoint.config),
                         parallel=2, max_batch_size=2, max_queue=4, warmup=False)
            if role == "prefill":
                service = PrefillService(cfg, checkpoint.model, checkpoint.tokenizer, allowlist=Allowlist(None),
                                         **sizes)
            else:
                service = DecodeService(cfg, checkpoint.model, checkpoint.tokenizer, **sizes)
            service.start()
            services.append(service)
        print(f"ready {len(services)}", flush=True)
        sys.stdin.read()
    finally:
        for service in services:
            service.close()


if __name__ == "__main__":
    serve(json.loads(Path(sys.argv[1]).read_text()))
