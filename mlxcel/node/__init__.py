"""Process supervision for one node without systemd (``mlxcel node``): a pidfile, a log, readiness by URL.

Module map: ``errors`` (``NodeSpecError``), ``spec`` (the node TOML), ``server`` (the ``[server]`` table
-> mlxcel-server's argv), ``supervisor`` (start, stop, restart, status over a pidfile).
"""
