# Sourced by the launch scripts that hand embeddings over a directory (ECExampleConnector), which never
# deletes one: each stays in $EC_DIR/<mm_hash>/encoder_cache.safetensors, and $EC_DIR is /dev/shm by
# default, that is memory. What deploy/kubernetes/base/ec-cache-cleanup.yaml does in a cluster, on one
# node: every EC_SWEEP_SECONDS (60), delete the embeddings older than EC_MAX_AGE_MINUTES (10: twice the
# longest call the middleware makes, EPD_PREFILL_TIMEOUT's 300 s, so none goes while its request can
# still be on its way to the engine; a reused one deleted since is encoded again), then the hash
# directories that have stood empty as long. When the servers have stopped, delete every embedding left,
# and $EC_DIR itself where ec_cache_start made it. Size /dev/shm for new images per second x embedding
# size x (EC_MAX_AGE_MINUTES + 1) minutes.
#
#   ec_cache_start                               creates $EC_DIR, starts the sweeper
#   trap 'kill ...the servers... 2>/dev/null || true; ec_cache_stop' EXIT INT TERM
#
# The '|| true': under set -e a failing command ends a trap, and kill fails for a server that has
# already exited, which is what ends the launch scripts' wait -n: the cleanup would never run.
EC_MAX_AGE_MINUTES="${EC_MAX_AGE_MINUTES:-10}"
EC_SWEEP_SECONDS="${EC_SWEEP_SECONDS:-60}"
EC_SWEEPER=""
EC_DIR_MADE=""

# Embeddings older than $1 minutes, then hash directories empty as long. rmdir leaves a directory an
# encoder has written into meanwhile.
ec_cache_sweep() {
  find "$EC_DIR" -mindepth 2 -maxdepth 2 -type f -name encoder_cache.safetensors -mmin "+$1" \
    -exec rm -f {} +
  find "$EC_DIR" -mindepth 1 -maxdepth 1 -type d -empty -mmin "+$1" -exec rmdir {} + 2>/dev/null
}

ec_cache_start() {
  if [ ! -d "$EC_DIR" ]; then EC_DIR_MADE=1; fi
  mkdir -p "$EC_DIR"
  # A failed sweep (a directory gone under find) must not end the sweeper: the launch scripts stop
  # every server when any of their children ends. Its sleep is a child it kills, so that stopping it
  # leaves no process behind.
  (
    trap 'kill "$nap" 2>/dev/null; exit 0' TERM
    while :; do
      sleep "$EC_SWEEP_SECONDS" &
      nap=$!
      wait "$nap"
      ec_cache_sweep "$EC_MAX_AGE_MINUTES" || true
    done
  ) &
  EC_SWEEPER=$!
}

# After the servers were told to stop: waits for every child (nothing still writes), then deletes every
# embedding left and their directories, and $EC_DIR where ec_cache_start made it. Anything else in $EC_DIR
# stays. Safe to run twice (the EXIT trap after INT or TERM).
ec_cache_stop() {
  if [ -n "$EC_SWEEPER" ]; then
    kill "$EC_SWEEPER" 2>/dev/null || true
    EC_SWEEPER=""
  fi
  wait || true
  [ -d "$EC_DIR" ] || return 0
  find "$EC_DIR" -mindepth 2 -maxdepth 2 -type f -name encoder_cache.safetensors -exec rm -f {} + || true
  find "$EC_DIR" -mindepth 1 -maxdepth 1 -type d -empty -exec rmdir {} + 2>/dev/null || true
  if [ -n "$EC_DIR_MADE" ]; then rmdir "$EC_DIR" 2>/dev/null || true; fi
}
