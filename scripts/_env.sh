# Sourced by the setup scripts: creates (or reuses) .venv with Python 3.12 and installs gla_tpu
# with the extras named in $GLA_EXTRAS. Fails with a clear message when no Python 3.12 exists.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

find_python312() {
  local candidates=("${PYTHON312:-}" python3.12)
  if command -v pyenv >/dev/null 2>&1; then
    candidates+=("$(pyenv root)/versions/3.12.1/bin/python3")
    for d in "$(pyenv root)"/versions/3.12*/bin/python3; do candidates+=("$d"); done
  fi
  for c in "${candidates[@]}"; do
    [ -n "$c" ] || continue
    if command -v "$c" >/dev/null 2>&1 || [ -x "$c" ]; then
      if "$c" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' 2>/dev/null; then
        echo "$c"; return 0
      fi
    fi
  done
  return 1
}

if [ ! -x .venv/bin/python ]; then
  py="$(find_python312)" || {
    echo "error: gla_tpu needs Python 3.12 (python3.12 on PATH, or set PYTHON312=/path/to/python3.12)." >&2
    exit 3
  }
  "$py" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[${GLA_EXTRAS}]"
