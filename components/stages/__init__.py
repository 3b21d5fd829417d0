"""Stage bodies: plain functions (no Prefect) that the flows call in-process or that torchrun
launches as `python -m components.stages.<stage>` (one process per GPU, rank 0 logs)."""
