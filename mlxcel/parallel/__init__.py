"""Tensor parallelism on MLX's distributed layer (``mx.distributed``): ``--tp-size N``.

Each rank holds a 1/N slice of every layer's attention heads and MLP width (mlx-lm's ``shard()``);
two all-reduces per layer join the slices. Rank 0 runs the scheduler and serves or prints; the
other ranks replay its steps (``follower``), told over the authenticated cluster transport
(``control``). docs/tp.md is the operator's page.

- ``options``: flags, defaults, the checks of their combinations (no MLX).
- ``plan``: which families shard, and the refusals before any weight is read (no MLX).
- ``reduce``: ``--tp-reduce-dtype``, the dtype the all-reduces carry.
- ``hostfile``: the multi-host hostfile (mlx.launch's JSON format) and the loopback rule.
- ``control``: the control messages (sans-I/O codec) and both ends of the channel.
- ``launch``: starting the local follower ranks, ring addresses, ``mx.distributed.init`` with a deadline.
- ``executor``: ``TPExecutor``, rank 0's executor for the scheduler.
- ``follower``: a follower rank's replay loop (``python -m mlxcel.parallel.follower``).
- ``session``: rank 0's side of a group (start, shard, executor, stop); the roles ``tp`` and ``tp-rank``
  (``mlxcel/entrypoints/tp.py``, ``tp_rank.py``) run it.
- ``generate``: ``mlxcel generate --tp-size N``.
"""
