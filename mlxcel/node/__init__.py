"""Process supervision for one node without systemd (``mlxcel node``): a pidfile, a log, readiness by URL."""
