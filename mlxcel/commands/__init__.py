"""The CLI's commands, one module each: ``generate``, ``plan``, ``convert``, ``models``, ``report``, ``node``,
``serve`` (with ``support``, ``windows`` and ``standby`` as helpers).

Each command module owns its parser, as vLLM's subcommands do: ``add_parser(subparsers)`` adds the
command and its flags and sets ``func`` to its ``run(args)``; ``mlxcel/cli.py`` loops over them. Only
these modules read the parsed ``argparse.Namespace``: ``serve`` turns it into typed flags
(``ServeFlags``, checked once), then one ``ServeConfig``, and runs the role it names (``mlxcel/entrypoints/``).
"""
