"""The corruption campaign of issue 32 (tests/faults/corruption.py) at its full size: 100
random byte flips or truncations across a 2-rank checkpoint (manifest included), a token
store and a consolidated export. Every damaged file must be detected at load and named,
and the undamaged artifacts must load with their exact content, in every trial."""

from __future__ import annotations

from tests.faults.corruption import FILES, run, summary


def test_100_of_100_damaged_files_detected_and_named(tmp_path):
    results = run(trials=100, seed=0, work=tmp_path)
    assert len(results) == 100
    assert {r["file"] for r in results} == set(FILES)  # every file was hit at least once
    failed = [r for r in results if not (r["detected"] and r["named"] and r["others_load"])]
    assert not failed, summary(results)
