"""The corruption campaign of issue 32 (tests/faults/corruption.py) at its full size: 100
random byte flips or truncations across a 2-rank checkpoint (manifest included), a token
store and a consolidated export. Every damaged file must be detected at load and named,
and the undamaged artifacts must load with their exact content, in every trial."""

from __future__ import annotations

from tests.faults.corruption import CKPT_FILES, FILES, run, summary


def test_100_of_100_damaged_files_detected_and_named(tmp_path):
    results = run(trials=100, seed=0, work=tmp_path)
    assert len(results) == 100
    assert {r["file"] for r in results} == set(FILES)  # every file was hit at least once
    failed = [r for r in results if not (r["detected"] and r["named"] and r["others_load"])]
    assert not failed, summary(results)


def test_damage_detected_on_the_hashing_thread_and_in_one_pass_partial_reads(tmp_path, monkeypatch):
    """The same contract with the load's newer paths forced at test size, on the
    checkpoint's files (the only ones they read): every key of a rank file hashed on the
    hashing thread (64-byte reads, 256-byte chunks, never declined), and every part of a
    key read by ``read_part`` (KEEP_BYTES 0)."""
    from meshtrain.checkpoint import rank_file, reader
    from meshtrain.files import hash_thread

    monkeypatch.setattr(rank_file, "THREAD_MIN", 1)
    monkeypatch.setattr(rank_file, "BLOCK", 64)
    monkeypatch.setattr(hash_thread, "CHUNK", 256)
    monkeypatch.setattr(hash_thread, "usable", lambda: True)
    monkeypatch.setattr(hash_thread, "core_free", lambda: True)
    monkeypatch.setattr(hash_thread, "INLINE_BYTES_PER_S", 0)
    monkeypatch.setattr(reader, "KEEP_BYTES", 0)
    results = run(trials=50, seed=1, work=tmp_path, files=CKPT_FILES)  # the paths are its
    assert {r["file"] for r in results} == set(CKPT_FILES)
    failed = [r for r in results if not (r["detected"] and r["named"] and r["others_load"])]
    assert not failed, summary(results)
