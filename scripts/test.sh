#!/usr/bin/env bash
# Sets up .venv (Python 3.12, gla_tpu[test]) and runs the test suite on this machine's CPUs.
# Extra arguments go to pytest. Exits with pytest's exit code unchanged (5 = no tests ran).
GLA_EXTRAS=test
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
workers="${PYTEST_WORKERS:-$(nproc)}"
set +e
.venv/bin/python -m pytest -n "$workers" --dist loadgroup --durations=25 "$@"
exit $?
