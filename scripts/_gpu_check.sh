# Sourced by the scripts/gpu_*_check.sh: what one call on the lent GPU machine needs.
#
#   gpu_check_setup NAME [peers]   work dir ($work), summary ($summary = $work/NAME.txt, GPU
#                                  name first), CUDA environment; with "peers", the wheels in
#                                  .whl/ installed into /tmp/site and fla's Triton cache in _tc/
#   step NAME SECONDS COMMAND...   runs COMMAND into $work/NAME.log under a time limit and
#                                  appends "NAME: rc=... (... s)" to the summary
#   gpu_check_finish NAME          $work packed into $OUT/NAME.tgz (the device tool returns
#                                  only a few files a call), the summary beside it, printed
gpu_check_setup() {
  local name=$1 peers=${2:-}
  out="${OUT:?set OUT (the device tool does)}"
  mkdir -p "$out"  # OUT=$OUT/a ... for a second run in one call
  work="$(mktemp -d)"
  export PYTHONPATH="$PWD" JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false
  if [[ "$peers" == peers ]]; then
    [[ -d /tmp/site/fla ]] || python3 -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --target /tmp/site .whl/*.whl || exit 3  # once per machine
    export PYTHONPATH="/tmp/site:$PWD" TRITON_CACHE_DIR="$PWD/_tc"
  fi
  summary="$work/$name.txt"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$summary"
}

step() {  # name, seconds, command...
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$work/$name.log" 2>&1
  echo "$name: rc=$? ($((SECONDS - start)) s)" >> "$summary"
}

gpu_check_finish() {
  local name=$1
  tar -czf "$out/$name.tgz" -C "$work" . 2>/dev/null
  cp "$summary" "$out/$name.txt"
  cat "$summary"
}
