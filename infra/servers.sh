#!/usr/bin/env bash
# Local servers for retro-realm: S3 (moto), MLflow tracking (+ proxied S3 artifacts), Prefect
# (+ a process work pool and one worker). Bound to 127.0.0.1; state, pids, ports and logs under
# .servers/ (gitignored).
#
#   infra/servers.sh up     [s3|mlflow|prefect|all]    # default all (s3, then mlflow and prefect at once); mlflow starts s3 first
#   infra/servers.sh down   [s3|mlflow|prefect|all]    # stops the whole process group of each
#   infra/servers.sh status [s3|mlflow|prefect|all]
#   infra/servers.sh logs   s3|mlflow|prefect|worker   # tail -n 50 of the log
#   eval "$(infra/env.sh)"                             # then point a shell at them
#
# Knobs (environment):
#   RR_BIND_HOST=127.0.0.1   RR_S3_PORT=9000  RR_MLFLOW_PORT=5000  RR_PREFECT_PORT=4200
#   RR_DVC_BUCKET=retro-realm-dvc  RR_MLFLOW_BUCKET=retro-realm-mlflow  RR_DATA_BUCKET=retro-realm-data
#   RR_SERVERS_DIR=.servers  RR_VENV=.venv  RR_START_TIMEOUT=120 (s)  RR_STOP_TIMEOUT=15 (s)
#   RR_S3_ENDPOINT_URL=         external S3/MinIO instead of moto (keys from your env)
#   RR_MLFLOW_BACKEND_URI=      default sqlite:///.servers/mlflow/mlflow.db; Postgres:
#                               postgresql://USER@HOST:5432/mlflow (needs psycopg2-binary; put the
#                               password in ~/.pgpass or PGPASSWORD, not in this URI)
#   RR_MLFLOW_ARTIFACTS_DESTINATION=s3://$RR_MLFLOW_BUCKET/
#   RR_MLFLOW_EXTRA_ARGS=       e.g. "--allowed-hosts myhost:5000" when RR_BIND_HOST is not loopback
#   RR_PREFECT_POOL=retro-realm-process   RR_PREFECT_UI=true
#   PREFECT_SERVER_DATABASE_{DRIVER=postgresql+asyncpg,HOST,PORT,USER,NAME,PASSWORD}  (Prefect on Postgres)
#
# Every server runs in its own session/process group (setsid) and `down` signals the group:
# TERM, a second TERM after RR_STOP_TIMEOUT, then KILL. Killing only the top PID would orphan
# mlflow's uvicorn child. moto keeps objects in memory, so `down s3` snapshots every bucket to .servers/s3/snapshot
# and `up s3` restores it (a crash loses changes since the last `down`).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STATE=${RR_SERVERS_DIR:-$REPO/.servers}
case "$STATE" in /*) ;; *) STATE=$REPO/$STATE ;; esac
export RR_SERVERS_DIR=$STATE
HOST=${RR_BIND_HOST:-127.0.0.1}
VENV=${RR_VENV:-$REPO/.venv}
START_TIMEOUT=${RR_START_TIMEOUT:-120}
STOP_TIMEOUT=${RR_STOP_TIMEOUT:-15}
POOL=${RR_PREFECT_POOL:-retro-realm-process}
BUCKETS=("${RR_DVC_BUCKET:-retro-realm-dvc}" "${RR_MLFLOW_BUCKET:-retro-realm-mlflow}" "${RR_DATA_BUCKET:-retro-realm-data}")

say() { echo "[servers] $*"; }
die() { echo "[servers] error: $*" >&2; exit 1; }

tool() {  # a console script from the venv, else from PATH
  if [ -x "$VENV/bin/$1" ]; then echo "$VENV/bin/$1"
  elif command -v "$1" >/dev/null 2>&1; then command -v "$1"
  else die "'$1' not found in $VENV/bin or PATH (run scripts/setup.sh)"; fi
}
PY=$(tool python)

case "$HOST" in
  127.*|localhost|::1) ;;
  *) echo "[servers] WARNING: binding to $HOST exposes unauthenticated MLflow/Prefect/S3 to the network" >&2 ;;
esac
case "$HOST" in 0.0.0.0|::) CHOST=127.0.0.1 ;; *) CHOST=$HOST ;; esac

# ---------------------------------------------------------------------------------------------
# process helpers
# ---------------------------------------------------------------------------------------------
port_busy() { (exec 3<>"/dev/tcp/$CHOST/$1") 2>/dev/null; }

http_ok() {  # URL -> 0 when it answers 2xx
  if command -v curl >/dev/null 2>&1; then curl -fsS -o /dev/null --max-time 2 "$1" 2>/dev/null
  else "$PY" -c 'import sys,urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "$1" 2>/dev/null; fi
}

alive() {  # PIDFILE -> 0 when its process group still has a member
  # The pid itself too: right after `spawn` the child may not have called setsid yet (a loaded
  # machine), and until it does no process group carries its pid.
  [ -f "$1" ] && { kill -0 -- "-$(cat "$1")" 2>/dev/null || kill -0 "$(cat "$1")" 2>/dev/null; }
}

spawn() {  # PIDFILE LOG CMD... : start CMD in a new session; its pid is also its process group id
  local pidfile=$1 log=$2; shift 2
  echo "===== $(date '+%F %T') start: $*" >>"$log"
  if command -v setsid >/dev/null 2>&1; then
    setsid "$@" >>"$log" 2>&1 </dev/null &
  else  # macOS has no setsid(1): same thing through Python, exec keeps the pid
    "$PY" -c 'import os,sys; os.setsid(); os.execvp(sys.argv[1], sys.argv[1:])' "$@" >>"$log" 2>&1 </dev/null &
  fi
  echo $! >"$pidfile"
}

group_pids() {  # PGID -> live (non-zombie) members
  ps -eo pid=,pgid=,stat= | awk -v g="$1" '$2 == g && $3 !~ /^Z/ {print $1}'
}

stop_group() {  # NAME PIDFILE [GRACE_S] [WRAPPER]: TERM, after GRACE a 2nd TERM, 2 s later KILL
  # WRAPPER=1: the leader only forwards signals to its child server (`mlflow server` -> uvicorn);
  # once the child has exited, the leader is killed instead of waiting out its ~3 s teardown.
  local name=$1 pidfile=$2 grace=${3:-$STOP_TIMEOUT} wrapper=${4:-0} pgid i
  if ! alive "$pidfile"; then rm -f "$pidfile"; say "$name: not running"; return 0; fi
  pgid=$(cat "$pidfile")
  kill -TERM -- "-$pgid" 2>/dev/null || true
  for ((i = 0; i < grace * 10; i++)); do
    alive "$pidfile" || break
    if [ "$wrapper" = 1 ] && [ "$(group_pids "$pgid")" = "$pgid" ]; then kill -KILL -- "-$pgid" 2>/dev/null || true; fi
    sleep 0.1
  done
  if alive "$pidfile"; then  # Prefect's CLIs treat a second TERM as "stop now"
    kill -TERM -- "-$pgid" 2>/dev/null || true
    for ((i = 0; i < 20; i++)); do alive "$pidfile" || break; sleep 0.1; done
  fi
  if alive "$pidfile"; then
    kill -KILL -- "-$pgid" 2>/dev/null || true
    say "$name: process group $pgid ignored TERM for $((grace + 2))s, killed"
  else
    say "$name: stopped (process group $pgid)"
  fi
  rm -f "$pidfile"
}

wait_http() {  # NAME URL PIDFILE LOG
  local name=$1 url=$2 pidfile=$3 log=$4 t0=$SECONDS
  while ! http_ok "$url"; do
    if ! alive "$pidfile"; then
      tail -n 30 "$log" >&2; rm -f "$pidfile"; die "$name exited during startup (log: $log)"
    fi
    if ((SECONDS - t0 > START_TIMEOUT)); then
      tail -n 30 "$log" >&2; stop_group "$name" "$pidfile"
      die "$name did not answer $url within ${START_TIMEOUT}s (log: $log)"
    fi
    sleep 0.2
  done
}

start_checks() {  # NAME DIR PORT -> 1 when already running
  local name=$1 dir=$2 port=$3
  mkdir -p "$dir"
  if alive "$dir/pid"; then say "$name: already running (pid $(cat "$dir/pid"), port $(cat "$dir/port" 2>/dev/null))"; return 1; fi
  port_busy "$port" && die "$name: port $port on $CHOST is taken by another process (set RR_$(echo "$name" | tr a-z A-Z)_PORT)"
  return 0
}

# The client/server environment (URLs, moto's dummy keys when unset) comes from env.sh.
load_env() { source "$REPO/infra/env.sh"; }

# ---------------------------------------------------------------------------------------------
# s3 (moto)
# ---------------------------------------------------------------------------------------------
up_s3() {
  if [ -n "${RR_S3_ENDPOINT_URL:-}" ]; then say "s3: using external endpoint $RR_S3_ENDPOINT_URL"; return 0; fi
  local dir=$STATE/s3 port=${RR_S3_PORT:-9000} t0=$SECONDS bargs=()
  start_checks s3 "$dir" "$port" || return 0
  local bin; bin=$(tool moto_server)
  spawn "$dir/pid" "$dir/log" "$bin" -H "$HOST" -p "$port"
  echo "$port" >"$dir/port"
  load_env
  wait_http s3 "http://$CHOST:$port/moto-api/" "$dir/pid" "$dir/log"
  for b in "${BUCKETS[@]}"; do bargs+=(--bucket "$b"); done
  # One Python call: restore the last snapshot (if any), then create the missing buckets.
  "$PY" "$REPO/infra/s3_state.py" init --endpoint "$AWS_ENDPOINT_URL" --dir "$dir/snapshot" "${bargs[@]}"
  say "s3: moto listening on http://$CHOST:$port  (pid $(cat "$dir/pid"), up in $((SECONDS - t0))s, log $dir/log)"
}

down_s3() {
  local dir=$STATE/s3
  if alive "$dir/pid"; then
    load_env
    "$PY" "$REPO/infra/s3_state.py" snapshot --endpoint "http://$CHOST:$(cat "$dir/port")" --dir "$dir/snapshot" \
      || say "s3: snapshot failed, keeping the previous one"
  fi
  stop_group s3 "$dir/pid"
}

# ---------------------------------------------------------------------------------------------
# mlflow
# ---------------------------------------------------------------------------------------------
up_mlflow() {
  alive "$STATE/s3/pid" || up_s3
  local dir=$STATE/mlflow port=${RR_MLFLOW_PORT:-5000} t0=$SECONDS
  start_checks mlflow "$dir" "$port" || return 0
  load_env
  local backend=${RR_MLFLOW_BACKEND_URI:-sqlite:///$dir/mlflow.db}
  local dest=${RR_MLFLOW_ARTIFACTS_DESTINATION:-s3://${RR_MLFLOW_BUCKET:-retro-realm-mlflow}/}
  local bin; bin=$(tool mlflow)
  (
    # No job runner: the server starts in ~8 s instead of ~18 s and spawns no huey workers.
    export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false
    # shellcheck disable=SC2086  # RR_MLFLOW_EXTRA_ARGS is word-split on purpose
    spawn "$dir/pid" "$dir/log" "$bin" server --host "$HOST" --port "$port" --workers 1 \
      --backend-store-uri "$backend" --artifacts-destination "$dest" ${RR_MLFLOW_EXTRA_ARGS:-}
  )
  echo "$port" >"$dir/port"
  wait_http mlflow "http://$CHOST:$port/health" "$dir/pid" "$dir/log"
  say "mlflow: listening on http://$CHOST:$port  (pid $(cat "$dir/pid"), up in $((SECONDS - t0))s, artifacts -> $dest, log $dir/log)"
}

down_mlflow() { stop_group mlflow "$STATE/mlflow/pid" "$STOP_TIMEOUT" 1; }

# ---------------------------------------------------------------------------------------------
# prefect (server, work pool, worker)
# ---------------------------------------------------------------------------------------------
up_prefect() {
  local dir=$STATE/prefect port=${RR_PREFECT_PORT:-4200} t0=$SECONDS ui=--ui
  [ "${RR_PREFECT_UI:-true}" = true ] || ui=--no-ui
  local bin; bin=$(tool prefect)
  if start_checks prefect "$dir" "$port"; then
    mkdir -p "$dir/home"
    (
      unset PREFECT_API_URL  # the server must not talk to another API: it *is* the API
      export PREFECT_HOME=$dir/home PREFECT_SERVER_ANALYTICS_ENABLED=false
      spawn "$dir/pid" "$dir/log" "$bin" server start --host "$HOST" --port "$port" "$ui"
    )
    echo "$port" >"$dir/port"
    wait_http prefect "http://$CHOST:$port/api/health" "$dir/pid" "$dir/log"
    say "prefect: listening on http://$CHOST:$port/api  (pid $(cat "$dir/pid"), up in $((SECONDS - t0))s, log $dir/log)"
  fi
  load_env
  export PREFECT_HOME=$dir/home
  if ! http_ok "$PREFECT_API_URL/work_pools/$POOL"; then
    "$bin" --no-prompt work-pool create "$POOL" --type process >/dev/null
    say "prefect: created process work pool $POOL"
  fi
  if alive "$dir/worker.pid"; then say "prefect: worker already running (pid $(cat "$dir/worker.pid"))"; return 0; fi
  # The worker's environment is what flow runs inherit: MLflow, S3 and Prefect URLs from env.sh.
  local i before=0
  [ -f "$dir/worker.log" ] && before=$(wc -l <"$dir/worker.log")
  (cd "$REPO" && spawn "$dir/worker.pid" "$dir/worker.log" "$bin" worker start \
    --pool "$POOL" --type process --name "retro-realm-local-$(hostname -s 2>/dev/null || echo worker)")
  for ((i = 0; i < 300; i++)); do  # ~60 s
    tail -n +"$((before + 1))" "$dir/worker.log" | grep "started!" >/dev/null && break
    alive "$dir/worker.pid" || { tail -n 30 "$dir/worker.log" >&2; die "prefect worker exited (log $dir/worker.log)"; }
    sleep 0.2
  done
  ((i < 300)) || say "prefect: worker not reported as started after 60 s; see $dir/worker.log"
  say "prefect: worker polling pool $POOL  (pid $(cat "$dir/worker.pid"), log $dir/worker.log)"
}

down_prefect() {
  # Worker first, so it can deregister. Prefect 3.9's worker does not exit on the first TERM/INT
  # (it means "finish in-flight runs"; it then idles), the second TERM kills it: a short grace.
  # Flow runs it launched live in their own sessions (Prefect's design) and are not stopped here.
  stop_group prefect-worker "$STATE/prefect/worker.pid" 3
  stop_group prefect "$STATE/prefect/pid"
}

# ---------------------------------------------------------------------------------------------
status_one() {  # NAME
  local name=$1 dir=$STATE/$1 port url health
  port=$(cat "$dir/port" 2>/dev/null || echo "-")
  case $name in
    s3) url=http://$CHOST:$port; health=$url/moto-api/ ;;
    mlflow) url=http://$CHOST:$port; health=$url/health ;;
    prefect) url=http://$CHOST:$port/api; health=$url/health ;;
  esac
  if alive "$dir/pid"; then
    if http_ok "$health"; then printf '%-8s up       %-28s pid %s\n' "$name" "$url" "$(cat "$dir/pid")"
    else printf '%-8s starting %-28s pid %s (no answer from %s)\n' "$name" "$url" "$(cat "$dir/pid")" "$health"; fi
  else
    printf '%-8s down\n' "$name"
  fi
  if [ "$name" = prefect ]; then
    if alive "$dir/worker.pid"; then printf '%-8s up       pool %-23s pid %s\n' worker "$POOL" "$(cat "$dir/worker.pid")"
    else printf '%-8s down\n' worker; fi
  fi
}

main() {
  local cmd=${1:-status} what=${2:-all} names
  case $what in
    all) names=(s3 mlflow prefect) ;;
    s3|mlflow|prefect) names=("$what") ;;
    worker) [ "$cmd" = logs ] || die "unknown server '$what'"; names=(worker) ;;
    *) die "unknown server '$what' (s3|mlflow|prefect|all)" ;;
  esac
  mkdir -p "$STATE"
  case $cmd in
    up) if [ "$what" = all ]; then
          up_s3
          # MLflow and Prefect need only S3 (MLflow's artifacts), not each other: both start at once,
          # each in its own subshell, whose `die` ends that subshell with its message.
          local mlflow_job prefect_job failed=""
          up_mlflow & mlflow_job=$!
          up_prefect & prefect_job=$!
          wait "$mlflow_job" || failed="mlflow"
          wait "$prefect_job" || failed="${failed:+$failed, }prefect"
          [ -z "$failed" ] || die "$failed did not start (see above); \`infra/servers.sh status\` shows what is up"
          say 'ready: eval "$(infra/env.sh)" to use them'
        else
          for n in "${names[@]}"; do "up_$n"; done
        fi ;;
    down) # reverse order: nothing loses its backend while still running
        for ((i = ${#names[@]} - 1; i >= 0; i--)); do "down_${names[i]}"; done ;;
    status) for n in "${names[@]}"; do status_one "$n"; done ;;
    logs) [ "$what" != all ] || die "logs needs one of s3|mlflow|prefect|worker"
          if [ "$what" = worker ]; then tail -n 50 "$STATE/prefect/worker.log"; else tail -n 50 "$STATE/$what/log"; fi ;;
    *) die "usage: infra/servers.sh {up|down|status|logs} [s3|mlflow|prefect|all]" ;;
  esac
}

main "$@"
