"""The role names, written once: the process roles of ``mlxcel serve`` and the subsets other modules need."""

from __future__ import annotations

#: every process role, in the order docs/server.md's table lists them (``mlxcel/entrypoints/`` has one module each)
ROLE_NAMES = ("single", "coordinator", "stage", "pp-auto", "pp-peer", "prefill", "decode", "router", "tp", "tp-rank")
#: the roles a ``[[nodes]]`` entry of the cluster TOML may name
PIPELINE_ROLES = ("coordinator", "stage")
DISAGG_ROLES = ("prefill", "decode", "router")
NODE_ROLES = PIPELINE_ROLES + DISAGG_ROLES
#: ``--node-role`` choices: a disaggregated role, or hybrid (the default: one node does everything)
HYBRID = "hybrid"
NODE_ROLE_CHOICES = DISAGG_ROLES + (HYBRID,)

assert set(NODE_ROLES) <= set(ROLE_NAMES)
