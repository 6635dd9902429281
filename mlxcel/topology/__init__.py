"""What every role reads about its cluster: neutral ground below the roles and the features.

Module map:

- ``names``           the role names, written once (process roles, TOML node roles, ``--node-role``)
- ``partition``       layer-range grammar, parameter bytes per layer, the stage split
- ``cluster_config``  the cluster TOML: nodes, roles, addresses, layers, timeouts
- ``distributed``     ``Distributed``: this node's place in its cluster, with the secret

No MLX, no sockets: pipeline, bring-up and disaggregated roles import these; these import none of them.
"""
