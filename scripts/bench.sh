#!/usr/bin/env bash
# Sets up .venv (Python 3.12, gla_tpu[bench]) and runs the attention-variants benchmark on the
# device that is present (CPU included). Extra arguments go to bench/attention_variants.py.
GLA_EXTRAS=bench
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
exec .venv/bin/python -m bench.attention_variants "$@"
