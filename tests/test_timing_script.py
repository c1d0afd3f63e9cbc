"""CPU tests of benchmarks/timing.py's arithmetic: ncu's CSV, what each workload is compared with,
and the pass/fail of the service runs (the GPU runs themselves are in the GPU batch)."""

from __future__ import annotations

import pytest

from benchmarks import timing

NCU_CSV = """\
"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"
"0","add","gpu__time_duration.sum","ns","4100"
"0","add","sm__cycles_elapsed.avg.per_second","cycle/second","1980000000"
"0","add","gr__cycles_active.max","cycle","5940"
"0","add","gr__cycles_elapsed.avg.per_second","cycle/second","1980000000"
"0","add","gpu__time_active.sum","ns","3000"
"0","add","sm__cycles_active.max","cycle","3960"
"1","add","gpu__time_duration.sum","ns","4300"
"1","add","sm__cycles_elapsed.avg.per_second","cycle/second","1980000000"
"1","add","gr__cycles_active.max","cycle","6138"
"1","add","gr__cycles_elapsed.avg.per_second","cycle/second","1980000000"
"1","add","gpu__time_active.sum","ns","3200"
"1","add","sm__cycles_active.max","cycle","3960"
"""


def test_ncu_csv_gives_the_duration_and_the_kernels_own_duration_three_ways() -> None:
    parsed = timing.parse_ncu_csv(NCU_CSV, iters=2)
    assert parsed is not None
    assert parsed["median_ms"] == pytest.approx(0.0042)
    assert parsed["sm_clock_mhz"] == pytest.approx(1980.0)
    own = parsed["own_by"]
    assert own["gr_active"] == pytest.approx((0.003 + 0.0031) / 2)
    assert own["time_active"] == pytest.approx(0.0031)
    assert own["sm_active"] == pytest.approx(0.002)


def test_ncu_csv_without_the_own_duration_metrics_still_gives_the_duration() -> None:
    lines = [line for line in NCU_CSV.splitlines() if "active" not in line and "gr__" not in line]
    parsed = timing.parse_ncu_csv("\n".join(lines), iters=2)
    assert parsed is not None and parsed["median_ms"] == pytest.approx(0.0042) and parsed["own_by"] == {}


def test_small_adds_are_compared_with_the_kernels_own_duration() -> None:
    row = {"median_ms": 0.0042, "own_by": {timing.NCU_OWN_MEASURE: 0.00305}}
    assert timing.ncu_reference_ms("add_256k_f32", row) == (0.00305, "kernel")
    assert timing.ncu_reference_ms("add_16m_f32", row) == (0.0042, "duration")
    assert timing.ncu_reference_ms("add_16m_f32", None) == (None, "-")


def _summary(medians: list[float], verdicts: list[str]) -> dict:
    reports = [{"integrity": {"verdict": v, "reasons": [] if v == "ok" else ["x"]}} for v in verdicts]
    return {"workloads": {"add_16m_f32": {"medians_ms": medians, "spread": timing.spread(medians), "reports": reports}}}


def test_the_service_runs_pass_when_all_ok_close_to_ncu_and_to_each_other() -> None:
    ncu = {"add_16m_f32": {"ncu": {"median_ms": 0.0447}}}
    good = _summary([0.0440, 0.0442, 0.0445], ["ok"] * 3)
    timing.judge_service(good, ncu)
    row = good["workloads"]["add_16m_f32"]
    assert row["pass"] and row["ok_programs"] == 3 and row["ncu_worst"] < 0.02
    spread_out = _summary([0.0440, 0.0470], ["ok"] * 2)  # 6.8% apart
    timing.judge_service(spread_out, ncu)
    assert not spread_out["workloads"]["add_16m_f32"]["pass"]
    one_suspect = _summary([0.0440, 0.0441], ["ok", "suspect"])
    timing.judge_service(one_suspect, ncu)
    assert not one_suspect["workloads"]["add_16m_f32"]["pass"]
    far_from_ncu = _summary([0.0400, 0.0401], ["ok"] * 2)  # 10% under ncu
    timing.judge_service(far_from_ncu, ncu)
    assert not far_from_ncu["workloads"]["add_16m_f32"]["pass"]
