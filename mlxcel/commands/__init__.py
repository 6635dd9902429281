"""The CLI's commands, one module each: ``generate``, ``serve``, ``plan``, ``node``, ``report``.

``mlxcel/cli.py`` parses the command line and calls one of them; ``serve`` parses the server's flags
into a ``ServeConfig`` once and runs the role it names (``mlxcel/roles/``).
"""
