#!/usr/bin/env bash
# Set everything up, then deploy the default model as a local 3-host pipeline cluster with Ansible:
# coordinator on http://127.0.0.2:8080 (OpenAI API), stages on 127.0.0.3 and 127.0.0.4, all on this machine
# (ansible-playbook deploy.yml -i inventory). Prints a sample chat answer and the URL. Re-running is safe.
#   bash scripts/serve.sh                          # deploy (extra arguments go to ansible-playbook, e.g. -e mlxcel_http_port=9000)
#   bash scripts/serve.sh --single [server args]   # one process on http://127.0.0.1:8080 instead (mlxcel-server)
#   .venv/bin/ansible-playbook teardown.yml -i inventory    # stop the cluster
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "${1:-}" = "--single" ]; then
  shift
  exec .venv/bin/mlxcel-server -m models/smollm2-135m-instruct "$@"
fi
echo "==> deploying the local cluster (ansible-playbook deploy.yml -i inventory)"
exec .venv/bin/ansible-playbook deploy.yml -i inventory "$@"
