#!/usr/bin/env bash
# The environment a shell needs to use the local servers started by `infra/servers.sh up`.
#
#   eval "$(infra/env.sh)"      # any POSIX shell: prints `export ...` lines, then eval them
#   source infra/env.sh         # bash/zsh: exports directly, prints nothing
#   eval "$(infra/env.sh --unset)"   # back to embedded mode (moto's dummy keys are unset too)
#
# Ports are read from .servers/<name>/port (written by the last `up`), else from RR_S3_PORT /
# RR_MLFLOW_PORT / RR_PREFECT_PORT (defaults 9000 / 5000 / 4200). Set RR_S3_ENDPOINT_URL to use an
# external S3 or MinIO instead of the local moto server.
#
# Credentials: only ever taken from your environment. The single exception is the local moto
# server, which accepts any key: when AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY are unset and the
# endpoint is the local one, the dummy value `testing` is suggested. Secrets are never printed:
# keys that you already exported are left alone and not echoed.

_rr_env() {
  local repo state host chost s3_port mlflow_port prefect_port s3_url
  repo=$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)
  state=${RR_SERVERS_DIR:-$repo/.servers}
  host=${RR_BIND_HOST:-127.0.0.1}
  # A server bound to all interfaces is still reached through the loopback address from here.
  case "$host" in 0.0.0.0|::|"[::]") chost=127.0.0.1 ;; *) chost=$host ;; esac
  s3_port=$(cat "$state/s3/port" 2>/dev/null || echo "${RR_S3_PORT:-9000}")
  mlflow_port=$(cat "$state/mlflow/port" 2>/dev/null || echo "${RR_MLFLOW_PORT:-5000}")
  prefect_port=$(cat "$state/prefect/port" 2>/dev/null || echo "${RR_PREFECT_PORT:-4200}")
  s3_url=${RR_S3_ENDPOINT_URL:-http://$chost:$s3_port}

  _RR_VARS=(
    "MLFLOW_TRACKING_URI=http://$chost:$mlflow_port"
    "PREFECT_API_URL=http://$chost:$prefect_port/api"
    "AWS_ENDPOINT_URL=$s3_url"
    "MLFLOW_S3_ENDPOINT_URL=$s3_url"
    "AWS_DEFAULT_REGION=${AWS_DEFAULT_REGION:-us-east-1}"
    "RR_DVC_REMOTE_URL=s3://${RR_DVC_BUCKET:-retro-realm-dvc}"
    "RR_DATA_URL=s3://${RR_DATA_BUCKET:-retro-realm-data}"
  )
  if [ -z "${RR_S3_ENDPOINT_URL:-}" ]; then
    [ -n "${AWS_ACCESS_KEY_ID:-}" ] || _RR_VARS+=("AWS_ACCESS_KEY_ID=testing")
    [ -n "${AWS_SECRET_ACCESS_KEY:-}" ] || _RR_VARS+=("AWS_SECRET_ACCESS_KEY=testing")
  elif [ -z "${AWS_ACCESS_KEY_ID:-}" ] || [ -z "${AWS_SECRET_ACCESS_KEY:-}" ]; then
    echo "[env] RR_S3_ENDPOINT_URL=$RR_S3_ENDPOINT_URL: export AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY yourself" >&2
  fi
}

_rr_env
if [ "${1:-}" = "--unset" ]; then
  for _kv in "${_RR_VARS[@]}"; do
    case "${_kv%%=*}" in AWS_DEFAULT_REGION|AWS_ACCESS_KEY_ID|AWS_SECRET_ACCESS_KEY) ;; *) echo "unset ${_kv%%=*}" ;; esac
  done
  # Credentials are unset only when they are the moto dummies; real keys stay.
  [ "${AWS_ACCESS_KEY_ID:-}" = testing ] && echo "unset AWS_ACCESS_KEY_ID"
  [ "${AWS_SECRET_ACCESS_KEY:-}" = testing ] && echo "unset AWS_SECRET_ACCESS_KEY"
elif (return 0 2>/dev/null); then  # sourced: export into the caller's shell
  for _kv in "${_RR_VARS[@]}"; do export "${_kv?}"; done
else
  for _kv in "${_RR_VARS[@]}"; do printf 'export %s=%q\n' "${_kv%%=*}" "${_kv#*=}"; done
fi
unset _kv _RR_VARS
unset -f _rr_env
