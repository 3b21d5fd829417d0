"""bench/gpu_check.py runs in its reduced CPU form, so the GPU script is known to work before a GPU
machine is lent (the numbers themselves are not asserted: timings are not test material)."""

import json

from bench.gpu_check import main


def test_gpu_check_reduced_cpu_form(tmp_path):
    out = tmp_path / "gpu_check.json"
    res = main(["--cpu", "--steps", "2", "--embed-blocks", "16", "--index-vectors", "2000", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["train"]["steps"] == 2 and saved["train"]["tokens_per_s"] > 0
    assert saved["train"]["flops_per_token"] > 0 and saved["refresh"]["index_vectors"] == 2000
    assert res["refresh"]["embed_blocks"] >= 16
    shard = saved["sharded_refresh"]  # 2 gloo ranks on the CPU: the same script path the GPU takes
    assert shard["ok"] and shard["ranks"] == 2 and shard["ranks_agree"], shard
    assert saved["nccl_ddp"]["ok"] is None and "skipped" in saved["nccl_ddp"]  # no second GPU here
