"""Thin Prefect flows, one per pipeline stage, plus the pipeline flow. Business logic lives in components/."""

import os

# Offline-friendly defaults (users may override them in their environment):
# no telemetry calls from a local Prefect server or from transformers.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "true")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
