"""Pipeline parallelism: the stage protocol, the stage service and the coordinator's executor (docs/pipeline.md).

Module map:

- ``protocol``       the stage protocol's messages and their strict JSON codec
- ``step_codec``     the binary step header (RUN_ENTRY, ACTIVATION, RUN_RESULT)
- ``params``         sampling parameters and token lists on the wire
- ``tensors``        tensor descriptors and their bounds
- ``stage``          ``StageService``: one stage's slice on the cluster transport
- ``slice_loading``  a stage's layers loaded without reading the other layers' weights
- ``coordinator``    ``PipelineExecutor``: the scheduler's executor over remote stages
- ``inprocess``      ``InProcessPipeline``: ``mlxcel generate --pp-size N`` in one process

The cluster TOML and the layer split live in ``mlxcel/topology/``; the roles ``stage`` and
``coordinator`` in ``mlxcel/entrypoints/``.
"""
