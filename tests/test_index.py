"""MIPS index layer: build, save/load round-trip, integrity, versioned store, atomic swap."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from components import io
from components.index import build as fb
from components.index.build import build_index
from components.index.faiss_index import BlockIndex, IndexStore
from components.index.index_files import IndexIntegrityError

REPO = Path(__file__).resolve().parents[1]


def _data(n=600, d=16, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, d)).astype(np.float32)


def _clustered(n=2000, d=16, seed=0):
    """Points around sqrt(n) centres: the structure real embeddings have and ANN relies on."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((int(np.sqrt(n)), d)).astype(np.float32)
    return centres[rng.integers(0, len(centres), n)] + 0.3 * rng.standard_normal((n, d)).astype(np.float32)


def _ids(n, prefix="blk"):
    return [f"{prefix}-{i:05d}" for i in range(n)]


# ----------------------------------------------------------------------------------------------
# building
# ----------------------------------------------------------------------------------------------
def test_flat_is_exact_inner_product():
    x = _data()
    q = _data(5, seed=1)
    bi = BlockIndex.build(x, _ids(len(x)), "flat")
    scores, rows = bi.search(q, 10)
    assert scores.dtype == np.float32 and rows.dtype == np.int64 and rows.shape == (5, 10)
    want = np.argsort(-(q @ x.T), axis=1)[:, :10]  # (5, 10)
    np.testing.assert_array_equal(rows, want)
    np.testing.assert_allclose(scores, np.take_along_axis(q @ x.T, want, axis=1), rtol=1e-5)
    assert bi.ids_for(rows[0, :2]).tolist() == [f"blk-{r:05d}" for r in want[0, :2]]


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_approximate_indexes_use_inner_product_and_find_most_neighbours(kind):
    x = _clustered(2000, 16)
    q = _clustered(20, 16, seed=3)
    exact = BlockIndex.build(x, None, "flat").search(q, 10)[1]
    bi = BlockIndex.build(x, None, kind)
    assert bi.index_type == kind
    assert bi.index.metric_type == fb.faiss.METRIC_INNER_PRODUCT
    rows = bi.search(q, 10)[1]
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(rows, exact)])
    assert recall > 0.9, recall


def test_auto_switches_on_corpus_size_and_ivf_nlist():
    assert fb.resolve_index_type(100, "auto", auto_flat_max=100) == "flat"
    assert fb.resolve_index_type(101, "auto", auto_flat_max=100) == "ivf"
    assert BlockIndex.build(_data(300), None, "auto", auto_flat_max=200).index_type == "ivf"
    assert BlockIndex.build(_data(300), None, "auto", auto_flat_max=300).index_type == "flat"
    with pytest.raises(ValueError):
        fb.resolve_index_type(10, "lsh")  # type: ignore[arg-type]
    # with GPUs, auto stays exact (sharded GPU flat) far beyond the CPU threshold
    assert fb.resolve_index_type(5_000_000, "auto", auto_flat_max=100, gpu=True) == "flat"
    assert fb.resolve_index_type(fb.GPU_FLAT_MAX + 1, "auto", auto_flat_max=100, gpu=True) == "ivf"
    assert fb.resolve_index_type(5_000_000, "auto", auto_flat_max=100, gpu=False) == "ivf"
    assert fb.resolve_index_type(5_000, "hnsw", gpu=True) == "hnsw"  # explicit types are kept
    assert fb.ivf_nlist(1_000_000) == 4000  # 4 sqrt(N)
    assert fb.ivf_nlist(10_000) == 256  # capped: >= 39 training points per list
    ivf = build_index(_data(2000), "ivf")
    assert ivf.nlist == fb.ivf_nlist(2000) and 1 <= ivf.nprobe <= ivf.nlist


def test_gpu_guard_on_cpu_faiss():
    if fb.gpu_count() > 0:
        pytest.skip("GPUs visible: the CPU-only guard is not what runs here")
    build_index(_data(50), "flat", use_gpu="auto")  # silently stays on the CPU
    with pytest.raises(RuntimeError, match="GPU"):
        build_index(_data(50), "flat", use_gpu=True)


def test_missing_results_and_bad_inputs():
    bi = BlockIndex.build(_data(3), ["a", "b", "c"], "flat")
    scores, rows = bi.search(_data(2, seed=4), 5)  # k > N
    assert (rows[:, 3:] == -1).all() and np.isneginf(scores[:, 3:]).all()
    assert bi.ids_for(rows)[0, 3:].tolist() == ["", ""]
    int_ids = BlockIndex.build(_data(3), None, "flat")
    assert int_ids.ids_for(np.array([2, -1])).tolist() == [2, -1]
    with pytest.raises(ValueError, match="dim"):
        bi.search(np.zeros((1, 7), np.float32), 1)
    with pytest.raises(ValueError, match="NaN"):
        build_index(np.full((4, 16), np.nan, np.float32), "flat")
    with pytest.raises(ValueError, match="one id per"):
        BlockIndex.build(_data(3), ["a"], "flat")


# ----------------------------------------------------------------------------------------------
# persistence
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw"])
def test_save_load_round_trip_gives_identical_results(tmp_path, kind):
    x = _data(1500, 16)
    q = _data(40, 16, seed=9)
    bi = BlockIndex.build(x, _ids(len(x)), kind, step=7)
    meta = bi.save(tmp_path / "idx", extra_meta={"encoder": "snap@7"})
    loaded = BlockIndex.load(tmp_path / "idx")

    s0, r0 = bi.search(q, 10)
    s1, r1 = loaded.search(q, 10)
    np.testing.assert_array_equal(r0, r1)
    np.testing.assert_array_equal(s0, s1)
    np.testing.assert_array_equal(bi.ids_for(r0), loaded.ids_for(r1))
    assert loaded.ids.dtype.kind == "U"
    on_disk = json.loads((tmp_path / "idx" / "meta.json").read_text())
    for key in ("n", "dim", "type", "build_seconds", "step", "files"):
        assert key in on_disk, key
    assert on_disk == meta and on_disk["type"] == kind and on_disk["step"] == 7 and on_disk["n"] == 1500
    assert on_disk["extra"] == {"encoder": "snap@7"}
    assert set(on_disk["files"]) == {"index.faiss", "ids.npy"}
    # ids.npy is plain numpy: loadable without pickle
    assert np.load(tmp_path / "idx" / "ids.npy", allow_pickle=False)[0] == "blk-00000"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize("victim", ["index.faiss", "ids.npy"])
def test_hash_mismatch_is_detected(tmp_path, victim):
    bi = BlockIndex.build(_data(200), _ids(200), "flat")
    bi.save(tmp_path / "idx")
    path = tmp_path / "idx" / victim
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF  # one flipped byte inside the payload
    path.write_bytes(bytes(raw))
    with pytest.raises(IndexIntegrityError, match="sha256"):
        BlockIndex.load(tmp_path / "idx")
    BlockIndex.load(tmp_path / "idx", verify=False)  # the check, not the parser, caught it


def test_incomplete_folder_is_rejected(tmp_path):
    BlockIndex.build(_data(20), None, "flat").save(tmp_path / "idx")
    (tmp_path / "idx" / "ids.npy").unlink()
    with pytest.raises(IndexIntegrityError, match="missing"):
        BlockIndex.load(tmp_path / "idx")
    with pytest.raises(IndexIntegrityError, match="meta.json"):
        BlockIndex.load(tmp_path)  # not an index folder
    with pytest.raises(FileExistsError):
        BlockIndex.build(_data(20), None, "flat").save(tmp_path / "idx")


# ----------------------------------------------------------------------------------------------
# versioned store
# ----------------------------------------------------------------------------------------------
def test_store_versions_current_first_latest_prune(tmp_path):
    store = IndexStore(tmp_path / "store")
    with pytest.raises(LookupError):
        store.current()
    xs = [_data(100, 8, seed=s) for s in range(4)]
    for step, x in enumerate(xs):
        assert store.publish(BlockIndex.build(x, None, "flat"), step=step * 10, extra_meta={"s": step}) == step + 1
    assert store.versions() == [1, 2, 3, 4]
    assert (tmp_path / "store" / "CURRENT").read_text().strip() == "v0004"
    cur = store.current()
    assert cur.version == 4 and cur.step == 30 and cur.meta["extra"] == {"s": 3}
    assert store.first().version == 1 and store.latest().version == 4
    np.testing.assert_array_equal(store.load(2).embeddings(), xs[1])

    store.set_current(2)  # roll back
    assert store.current().version == 2 and store.current_version() == 2
    assert store.prune(keep_last=1) == [3]  # keeps first (1), CURRENT (2), newest (4)
    assert store.versions() == [1, 2, 4]
    assert store.publish(BlockIndex.build(xs[0], None, "flat")) == 5  # numbers never reused


def test_fresh_store_follows_current_pointer_and_reload(tmp_path):
    writer = IndexStore(tmp_path)
    writer.publish(BlockIndex.build(_data(50, seed=1), None, "flat"), step=1)
    writer.publish(BlockIndex.build(_data(50, seed=2), None, "flat"), step=2, make_current=False)
    reader = IndexStore(tmp_path)  # another process, say
    assert reader.current().version == 1  # CURRENT, not the newest directory
    assert reader.reload() is False
    writer.set_current(2)
    assert reader.reload() is True and reader.current().version == 2


def test_swap_is_in_memory_only(tmp_path):
    store = IndexStore(tmp_path)
    store.publish(BlockIndex.build(_data(30, seed=1), None, "flat"), step=1)
    mem = BlockIndex.build(_data(30, seed=2), None, "flat")
    old = store.swap(mem)
    assert old.version == 1 and store.current() is mem
    assert IndexStore(tmp_path).current().version == 1  # disk unchanged
    with pytest.raises(TypeError):
        store.swap("not an index")  # type: ignore[arg-type]


def test_tmp_leftovers_are_never_loaded_and_are_cleaned(tmp_path):
    root = tmp_path / "store"
    store = IndexStore(root)
    store.publish(BlockIndex.build(_data(40, seed=1), None, "flat"), step=1)
    # A refresh killed mid-publish (os._exit between writing the files and the rename).
    script = (
        "import os, numpy as np\n"
        "from components import io\n"
        "from components.index import faiss_index as fi\n"
        "io.commit_dir = lambda *a, **k: os._exit(9)\n"
        f"s = fi.IndexStore({str(root)!r})\n"
        "s.publish(fi.BlockIndex.build(np.ones((40, 16), np.float32), None, 'flat'), step=2)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 9, proc.stderr
    assert (root / ".tmp-v0002" / "meta.json").is_file()  # complete files, but never renamed
    (root / ".tmp-CURRENT-dead").write_text("v0002\n")  # a pointer write that never landed

    fresh = IndexStore(root)
    assert fresh.versions() == [1] and fresh.latest_version() == 1
    assert fresh.current().version == 1 and fresh.current_version() == 1
    removed = sorted(p.name for p in fresh.cleanup_partial())
    assert removed == [".tmp-CURRENT-dead", ".tmp-v0002"]
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert fresh.publish(BlockIndex.build(_data(40, seed=3), None, "flat"), step=3) == 2
    assert IndexStore(root).current().step == 3


def test_publish_failure_keeps_old_current_and_leaves_no_tmp(tmp_path, monkeypatch):
    store = IndexStore(tmp_path)
    store.publish(BlockIndex.build(_data(40, seed=1), None, "flat"), step=1)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(io, "commit_dir", boom)
    with pytest.raises(OSError, match="disk full"):
        store.publish(BlockIndex.build(_data(40, seed=2), None, "flat"), step=2)
    assert store.current().version == 1 and store.current_version() == 1
    assert store.versions() == [1]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_atomic_swap_under_concurrent_reads(tmp_path):
    """Readers hammer `search` while a writer publishes 20 versions (and swaps an in-memory one
    between them): every result must equal one version's answer exactly, with no exception."""
    n, d, k, n_versions = 256, 16, 5, 20
    q = _data(6, d, seed=999)
    versions = {}  # version -> (x, expected rows, expected ids)
    for v in range(1, n_versions + 1):
        x = _data(n, d, seed=v)
        rows = np.argsort(-(q @ x.T), axis=1)[:, :k]
        versions[v] = (x, rows, np.asarray(_ids(n, f"v{v}"))[rows])
    expected = [versions[v][1] for v in versions]
    assert len({r.tobytes() for r in expected}) == n_versions  # answers tell versions apart

    store = IndexStore(tmp_path)
    store.publish(BlockIndex.build(versions[1][0], _ids(n, "v1"), "flat").with_meta(tag=1), step=1)
    stop = threading.Event()
    errors: list[BaseException] = []
    seen: set[int] = set()

    def reader():
        try:
            while not stop.is_set():
                scores, rows = store.search(q, k)
                matches = [v for v, (_, r, _) in versions.items() if np.array_equal(rows, r)]
                assert len(matches) == 1, f"result matches versions {matches}"
                x = versions[matches[0]][0]
                np.testing.assert_allclose(scores, np.take_along_axis(q @ x.T, rows, axis=1), rtol=1e-4, atol=1e-4)
                bi = store.current()  # index and its ids/meta always belong together
                _, r2 = bi.search(q, k)
                v2 = bi.meta["tag"]
                np.testing.assert_array_equal(r2, versions[v2][1])
                np.testing.assert_array_equal(bi.ids_for(r2), versions[v2][2])
                seen.add(matches[0])
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        for v in range(2, n_versions + 1):
            bi = BlockIndex.build(versions[v][0], _ids(n, f"v{v}"), "flat").with_meta(tag=v)
            if v % 5 == 0:  # in-memory swap only (the training loop's step-boundary swap)
                store.swap(bi)
            else:
                store.publish(bi, step=v)
            if errors:
                break
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert not errors, errors[0]
    assert len(seen) >= 2, seen  # the readers really did run across swaps
    assert store.current().meta["tag"] == n_versions  # the last change was an in-memory swap
    assert store.current_version() == store.latest_version() == 16  # 1 + 18 published - 3 swaps
