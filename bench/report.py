"""The figures of one `make bench` run as the rows of bench/README.md's table,
so the README is copied from the JSON, never typed:

    .venv/bin/python -m bench.report bench/results/latest.json [bench/results/scale.json]

(the second, `make bench-scale`'s, adds the scale curve's rows).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _ratio(ours: float, bare: float) -> str:
    return f"{ours / bare:.2f}" if bare else "—"


def _n(value: float) -> float:
    """A median figure as measured, without the float noise of a mean of two
    (results before the throughput rounded its medians carry it)."""
    return round(value, 2)


def rows(figures: dict[str, Any]) -> list[str]:
    """One markdown row a figure: figure | bare | ours | ratio | target."""
    a = figures["approvals"]
    out = []
    targets = (
        ("result", "≤ 1.2 (p95 ≤ 1.5)"),
        ("pickup", ""),  # part of the result's time; runs before 2026-12-07 lack it
        ("write", "≤ 1.5"),
        ("update", "≤ 1.5"),
    )
    for key, target in targets:
        if key not in a:
            continue
        f = a[key]
        out.append(
            f"| {f['what']}, p50 (p95) | {f['bare']['p50_ms']} ms ({f['bare']['p95_ms']}) "
            f"| {f['ours']['p50_ms']} ms ({f['ours']['p95_ms']}) "
            f"| {f['ratio_p50']} ({f['ratio_p95']}) | {target} |"
        )
    c = a["worker_cpu_per_approval"]
    out.append(
        f"| worker CPU per approval | {c['bare_ms']} ms | {c['ours_ms']} ms | {c['ratio']} | ≤ 2 |"
    )
    t = figures["throughput"]
    # Since several batch pairs are taken, the figures are the median pair's.
    pairs = f", median of {t['batches']} batch pairs" if t.get("batches", 1) > 1 else ""
    out.append(
        f"| runs/s, {t['runs_at_once']} at once{pairs} | {_n(t['bare']['runs_per_s'])} "
        f"| {_n(t['ours']['runs_per_s'])} | {t['ratio_runs_per_s']} | ≥ 0.8 |"
    )
    out.append(
        f"| worker CPU per run | {_n(t['bare']['cpu_ms_per_run'])} ms "
        f"| {_n(t['ours']['cpu_ms_per_run'])} ms | {t['ratio_cpu_per_run']} | ≤ 2 |"
    )
    if "server_cpu_ms_per_run" in t["ours"]:  # runs before it was taken lack it
        out.append(
            f"| dev server CPU per run | {_n(t['bare']['server_cpu_ms_per_run'])} ms "
            f"| {_n(t['ours']['server_cpu_ms_per_run'])} ms | | |"
        )
    h = a["history_events"]
    out.append(
        f"| history events per approved write | {h['bare_workflow']} (whole workflow) "
        f"| {h['ours_per_approved_write']} | | ≤ 15 |"
    )
    w = figures["waiting_memory"]
    out.append(
        f"| worker memory per run waiting ({w['runs_waiting']} a side) "
        f"| {w['bare']['kib_per_run']} KiB | {w['ours']['kib_per_run']} KiB | {w['ratio']} "
        "| ≤ 100 KiB |"
    )
    for database in ("sqlite", "postgresql"):
        claims = figures["claims"].get(database)
        if not isinstance(claims, dict):
            out.append(f"| store claim ({database}) | | {claims} | | |")
            continue
        for mode in ("sequential", "concurrent"):
            m = claims[mode]
            out.append(
                f"| store claim, {mode} ({database}), claims/s | {m['baseline_per_s']} "
                f"| {m['store_claims_per_s']} | {m['ratio']} | ≥ 0.5 |"
            )
            if "cold_ratio" in m:  # results from before 2026-12-07 have none
                out.append(
                    f"| its first pass, {mode} ({database}), on a fresh engine (statements "
                    f"compiled, connections opened, statements prepared), claims/s "
                    f"| {m['cold_baseline_per_s']} | {m['cold_store_claims_per_s']} "
                    f"| {m['cold_ratio']} | |"
                )
            if "floor_ratio" in m:
                out.append(
                    f"| its floor, {mode} ({database}): µs a claim replayed with no Python of "
                    f"its own (bench/claim_floor.py), and the ratio it would reach "
                    f"| {m['replayed_us_per_upsert']} µs | {m['replayed_us_per_claim']} µs "
                    f"| {m['floor_ratio']} | |"
                )
            elif "floor" in m:
                out.append(f"| its floor, {mode} ({database}) | | {m['floor']} | | |")
        s = claims["sequential"]
        out.append(
            f"| statements per claim ({database}) | {s['baseline_statements']} "
            f"| {s['statements_per_claim']} | | |"
        )
        out.append(
            f"| round trips per claim ({database}) | {s['baseline_round_trips']} "
            f"| {s['round_trips_per_claim']} | | ≤ 2 + its BEGIN and COMMIT |"
        )
    k = figures["crash_to_unknown"]
    out.append(
        f"| crash → unknown, median (max) | | {k['unknown_after_s_median']} s "
        f"({k['unknown_after_s_max']} s) | | ≤ {k['target_s']} s "
        f"(heartbeat {k['heartbeat_timeout_s']} s + 2) |"
    )
    for s in figures["scaling"]:
        out.append(
            f"| {s['runs_at_once']} runs at once: runs/s; CPU per run "
            f"| {s['bare']['runs_per_s']}; {s['bare']['cpu_ms_per_run']} ms "
            f"| {s['ours']['runs_per_s']}; {s['ours']['cpu_ms_per_run']} ms "
            f"| {s['ratio_runs_per_s']}; {s['ratio_cpu_per_run']} | |"
        )
    sc = figures.get("scale")
    if isinstance(sc, dict) and "skipped" in sc:
        out.append(f"| scale curve (postgresql) | | {sc['skipped']} | | |")
    elif isinstance(sc, dict):
        for point in sc["curve"]:
            cpu = "; ".join(f"{part} {ms} ms" for part, ms in point["cpu_ms_per_run"].items())
            out.append(
                f"| scale: {point['workers']} worker process(es) ({point['split']}), "
                f"{sc['runs_at_once']} runs at once, PostgreSQL: runs/s | "
                f"| {point['runs_per_s']} (CPU per run: {cpu}; machine busy "
                f"{point['machine_busy']}) | | |"
            )
    return out


def main() -> None:
    figures = json.loads(Path(sys.argv[1]).read_text())
    for more in sys.argv[2:]:
        figures.update(json.loads(Path(more).read_text()))
    print("| figure | bare | ours | ratio | target |")
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(rows(figures)))
    took = ", ".join(f"{k} {v} s" for k, v in figures.get("seconds_by_figure", {}).items())
    print(f"\nAll figures in {figures['seconds']} s ({took}).")
    measured = figures.get("source") or {}
    if measured.get("commit"):
        state = {True: "clean", False: "with changes not committed"}.get(measured.get("clean"))
        print(f"Measured on commit {measured['commit']}" + (f", {state}." if state else "."))


if __name__ == "__main__":
    main()
