"""The packages of mlxcel sit in a declared order of layers, and no import runs from a lower layer up.

Every import counts (module level, inside functions, under ``if TYPE_CHECKING``), as in
``test_import_graph``. Members of one layer do not import each other either: the four features
(pipeline, bring-up, disaggregated roles, tensor parallelism) stand side by side on what is below
them, and only the roles and the commands put them together. There is no list of exceptions.
"""

from __future__ import annotations

from pathlib import Path

from tests.test_import_graph import import_graph

PACKAGE = Path(__file__).resolve().parents[1] / "mlxcel"

#: lowest first; a member is a package or module prefix, "foundation" the small top-level modules
LAYERS: tuple[tuple[str, ...], ...] = (
    ("foundation",),  # mlxcel, errors, error_codes, flagset, config, envs, threads, private_file, strict_json, blas, blas_shim
    ("mlxcel.cluster",),  # sockets, crypto, frames, transport: no MLX
    ("mlxcel.models",),  # checkpoints, identity, GGUF import, model facts
    ("mlxcel.topology",),  # what every role reads: role names, layer ranges, cluster TOML, Distributed
    ("mlxcel.engine",),  # scheduler, executors, slices, sampling
    ("mlxcel.process",),  # socket, exit switch, uvicorn plumbing
    ("mlxcel.server", "mlxcel.loading_process"),  # the HTTP library; a loading node's /health shell
    ("mlxcel.pipeline", "mlxcel.bringup", "mlxcel.disagg", "mlxcel.parallel"),  # the features, side by side
    ("mlxcel.report", "mlxcel.node"),  # benchmark reports; the node supervisor
    ("mlxcel.entrypoints",),  # one module per process role, and the role table
    ("mlxcel.commands",),  # generate, serve, plan, node, report
    ("mlxcel.cli",),  # argument parsing only
    ("mlxcel.__main__",),  # python -m mlxcel
)
FOUNDATION = {"mlxcel", "mlxcel.errors", "mlxcel.flagset", "mlxcel.error_codes", "mlxcel.config", "mlxcel.envs", "mlxcel.threads", "mlxcel.private_file", "mlxcel.strict_json",
              "mlxcel.blas", "mlxcel.blas_shim"}


def member_of(module: str, layers: tuple[tuple[str, ...], ...] = LAYERS) -> tuple[int, str]:
    """(layer index, member) of a module; KeyError for a module no layer declares."""
    if module in FOUNDATION:
        return 0, "foundation"
    for index, members in enumerate(layers):
        for member in members:
            if module == member or module.startswith(member + "."):
                return index, member
    raise KeyError(module)


def violations(graph: dict[str, dict[str, int]], layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[str]:
    """One line per import that climbs to a higher layer or crosses to a peer of the same layer."""
    found = []
    for module, edges in sorted(graph.items()):
        layer, member = member_of(module, layers)
        for target, line in sorted(edges.items()):
            target_layer, target_member = member_of(target, layers)
            if target_layer > layer or (target_layer == layer and target_member != member):
                found.append(f"{module} (line {line}) imports {target}: layer {layer} {member} -> "
                             f"layer {target_layer} {target_member}")
    return found


def test_every_module_belongs_to_a_declared_layer():
    undeclared = []
    for module in import_graph(PACKAGE):
        try:
            member_of(module)
        except KeyError:
            undeclared.append(module)
    assert not undeclared, f"modules outside every layer (declare them in LAYERS): {undeclared}"


def test_no_import_runs_from_a_lower_layer_to_a_higher_one():
    graph = import_graph(PACKAGE)
    assert "mlxcel.topology.cluster_config" in graph["mlxcel.pipeline.coordinator"]  # the graph sees imports
    found = violations(graph)
    assert not found, "imports against the layer order:\n  " + "\n  ".join(found)


def test_no_module_outside_roles_and_commands_imports_a_role():
    from mlxcel.entrypoints import ROLES

    graph = import_graph(PACKAGE)
    role_modules = {role.module for role in ROLES.values()} | {"mlxcel.entrypoints", "mlxcel.entrypoints.context"}
    outside = [f"{module} imports {target}" for module, edges in graph.items()
               if not module.startswith(("mlxcel.entrypoints", "mlxcel.commands")) for target in edges
               if target in role_modules]
    assert not outside, outside


def test_an_upward_import_and_a_peer_import_are_both_reported():
    layers = (("foundation",), ("pkg.low",), ("pkg.a", "pkg.b"), ("pkg.high",))
    graph = {"pkg.low.x": {"pkg.high.y": 3}, "pkg.a.m": {"pkg.b.n": 7, "pkg.low.x": 1}, "pkg.b.n": {},
             "pkg.high.y": {"pkg.a.m": 2}}
    assert violations(graph, layers) == [
        "pkg.a.m (line 7) imports pkg.b.n: layer 2 pkg.a -> layer 2 pkg.b",
        "pkg.low.x (line 3) imports pkg.high.y: layer 1 pkg.low -> layer 3 pkg.high",
    ]
