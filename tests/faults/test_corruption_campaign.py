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


def test_damage_detected_in_one_pass_partial_reads(tmp_path, monkeypatch):
    """The same contract with every key checked as a part of it is read, hashed in place
    in windows (``RankFile.verify_key``: 64-byte windows here, so many per key) and whole
    keys read in 64-byte blocks, on the checkpoint's files (the only ones it reads)."""
    from meshtrain.checkpoint import rank_file

    monkeypatch.setattr(rank_file, "BLOCK", 64)
    monkeypatch.setattr(rank_file.checksums, "WINDOW", 64)
    results = run(trials=50, seed=1, work=tmp_path, files=CKPT_FILES)
    assert {r["file"] for r in results} == set(CKPT_FILES)
    failed = [r for r in results if not (r["detected"] and r["named"] and r["others_load"])]
    assert not failed, summary(results)
