#!/usr/bin/env bash
# Point this checkout's DVC at an S3(-compatible) remote, from the environment. Idempotent.
#
#   RR_DVC_REMOTE_URL=s3://retro-realm-dvc/cache RR_S3_ENDPOINT_URL=http://127.0.0.1:9000 \
#     bash scripts/dvc_remote.sh             # -> .dvc/config.local (default remote "s3")
#   bash scripts/dvc_remote.sh --project     # URL into .dvc/config (commit it); endpoint stays local
#   bash scripts/dvc_remote.sh --check       # also check that the bucket answers (boto3 head_bucket)
#   bash scripts/dvc_remote.sh --show        # print the effective remote (never any key)
#
# Environment:
#   RR_DVC_REMOTE_URL   s3://BUCKET/PREFIX   (default s3://${RR_DVC_BUCKET:-retro-realm-dvc}/cache)
#   RR_DVC_REMOTE_NAME  remote name          (default s3)
#   RR_S3_ENDPOINT_URL  endpoint of MinIO/moto/any S3-compatible store; else AWS_ENDPOINT_URL_S3,
#                       else AWS_ENDPOINT_URL; none of them set = real AWS S3 (endpoint removed)
#   AWS_PROFILE         written as the remote's `profile` (a name, not a secret) when set
#   AWS_DEFAULT_REGION / AWS_REGION   written as `region` when set
#   DVC                 the dvc executable (default .venv/bin/dvc, else dvc on PATH)
#
# Credentials are never written anywhere: DVC (dvc-s3 -> s3fs -> botocore) reads them at push/pull
# time from the usual chain: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (/ AWS_SESSION_TOKEN),
# AWS_SHARED_CREDENTIALS_FILE or ~/.aws/credentials (AWS_PROFILE), or an instance/pod role.
#
# Why `--local` by default: the endpoint (and often the bucket) is a property of the machine -
# moto on a laptop's loopback, MinIO inside a cluster, real S3 in the cloud - so it belongs to the
# untracked .dvc/config.local (gitignored by .dvc/.gitignore), and running this script never dirties
# the repo or dvc.lock's git state. A team that shares one bucket can commit the URL with
# `--project`; the endpoint is still written locally. Remote workers run this script in their pull
# step (infra/prefect/prefect.remote.yaml) from their job's environment.
set -euo pipefail
cd "$(dirname "$0")/.."

scope=local check=0 show=0
for arg in "$@"; do
  case $arg in
    --local) scope=local ;;
    --project) scope=project ;;
    --check) check=1 ;;
    --show) show=1 ;;
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
    *) echo "dvc_remote.sh: unknown option $arg (--local|--project|--check|--show)" >&2; exit 2 ;;
  esac
done

if [ -n "${DVC:-}" ]; then :
elif [ -x .venv/bin/dvc ]; then DVC=.venv/bin/dvc
elif command -v dvc >/dev/null 2>&1; then DVC=dvc
else echo "dvc_remote.sh: dvc not found (run scripts/setup.sh or set DVC=...)" >&2; exit 1; fi

name=${RR_DVC_REMOTE_NAME:-s3}
url=${RR_DVC_REMOTE_URL:-s3://${RR_DVC_BUCKET:-retro-realm-dvc}/cache}
endpoint=${RR_S3_ENDPOINT_URL:-${AWS_ENDPOINT_URL_S3:-${AWS_ENDPOINT_URL:-}}}
region=${AWS_DEFAULT_REGION:-${AWS_REGION:-}}

case $url in
  s3://?*) ;;
  *) echo "dvc_remote.sh: RR_DVC_REMOTE_URL must be s3://BUCKET[/PREFIX], got '$url'" >&2; exit 2 ;;
esac
case $url in *@*|*\?*) echo "dvc_remote.sh: no credentials or query strings in RR_DVC_REMOTE_URL" >&2; exit 2 ;; esac

if [ "$show" = 1 ]; then
  "$DVC" remote list --local 2>/dev/null || true
  "$DVC" remote list --project 2>/dev/null || true
  exit 0
fi

if [ "$scope" = project ]; then
  "$DVC" remote add --project --default --force "$name" "$url"
else
  "$DVC" remote add --local --default --force "$name" "$url"
fi

# Machine-specific settings always go to config.local. `--unset` keeps reruns idempotent when a
# variable was set once and is not any more.
set_local() {  # OPTION VALUE  (empty VALUE -> unset)
  if [ -n "$2" ]; then "$DVC" remote modify --local "$name" "$1" "$2"
  else "$DVC" remote modify --local --unset "$name" "$1" 2>/dev/null || true; fi
}
set_local endpointurl "$endpoint"
set_local region "$region"
set_local profile "${AWS_PROFILE:-}"

echo "[dvc_remote] default remote '$name' -> $url (${scope} config)${endpoint:+, endpoint $endpoint}${AWS_PROFILE:+, profile $AWS_PROFILE}"

if [ "$check" = 1 ]; then
  PY=python3
  [ -x .venv/bin/python ] && PY=.venv/bin/python
  "$PY" - "$url" "$endpoint" <<'EOF'
import sys

import boto3
from botocore.exceptions import BotoCoreError, ClientError

url, endpoint = sys.argv[1], sys.argv[2] or None
bucket = url[len("s3://"):].split("/", 1)[0]
try:
    boto3.client("s3", endpoint_url=endpoint).head_bucket(Bucket=bucket)
except (BotoCoreError, ClientError) as e:
    sys.exit(f"[dvc_remote] bucket {bucket!r} at {endpoint or 'AWS S3'} is not reachable with the "
             f"credentials in this environment: {e}")
print(f"[dvc_remote] bucket {bucket!r} answers")
EOF
fi
