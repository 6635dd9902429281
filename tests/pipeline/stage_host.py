"""One process hosting pipeline stages of several clusters: ``python -m tests.pipeline.stage_host NODE TOML...``.

For each cluster TOML it serves node ``NODE`` (``stage-0``, ``stage-1``, ...) exactly as the ``stage`` role
of ``mlxcel-server`` builds it (``mlxcel.roles.stage``): ``load_stage_runner`` over the TOML's
``model_dir`` comment line, then ``StageService`` on the node's address, under the TOML's secret. It
prints ``ready N`` once every stage listens, and serves until its stdin closes. The family tables use it
so that the stages of every family run in two processes instead of two per family.
"""

from __future__ import annotations

import sys
from pathlib import Path


def serve(node_id: str, tomls: list[Path]) -> None:
    import mlxcel  # noqa: F401  (OpenBLAS first)
    from mlxcel.cluster.secret import load_secret
    from mlxcel.models.facts import model_facts
    from mlxcel.pipeline.slice_loading import load_stage_runner
    from mlxcel.pipeline.stage import StageService
    from mlxcel.topology.cluster_config import load_cluster_config

    services = []
    try:
        for toml in tomls:
            model_dir = Path(toml.read_text().splitlines()[0].removeprefix("# model_dir = "))
            cluster = load_cluster_config(toml)
            node = next(n for n in cluster.stages if n.id == node_id)
            assert node.layers is not None
            runner, _ = load_stage_runner(model_dir, *node.layers, max_rows=cluster.max_batch_size)
            secret = load_secret(toml_secret_file=cluster.secret_file, env={})
            service = StageService(cluster, node_id, runner, secret, model_facts(model_dir))
            service.start()
            services.append(service)
        print(f"ready {len(services)}", flush=True)
        sys.stdin.read()
    finally:
        for service in services:
            service.close()


if __name__ == "__main__":
    serve(sys.argv[1], [Path(p) for p in sys.argv[2:]])
