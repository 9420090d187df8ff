#!/usr/bin/env bash
# External conformance: replay AgentDojo's 97 user tasks through our render -> parse -> MCP path
# (tests/conformance/agentdojo_replay.py). AgentDojo pulls LLM SDKs we do not want in the main environment, so it
# gets its own virtualenv, keyed by the hash of its requirements and kept outside the clone like .ci/run's.
# Exits non-zero when a task fails or a negative control passes. Runs locally the same way.
set -euo pipefail
cd "$(dirname "$0")/.."

reqs=tests/conformance/requirements-agentdojo.txt
key=$(cat "$reqs" | sha256sum | cut -c1-16)
venv="${MERCURY_VENV_ROOT:-$HOME/.cache/mercury_jax}/agentdojo-$key"
if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/.complete" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q -r "$reqs"
  touch "$venv/.complete"
fi
start=$(date +%s)
"$venv/bin/python" tests/conformance/agentdojo_replay.py "$@"
echo "agentdojo conformance: $(( $(date +%s) - start )) s"
