"""Pipeline parallelism: partitioning, stage service, coordinator, cluster TOML."""
