"""bench.tier_costs end to end on the tiny model (--smoke): the three parts run and report
what the benchmark claims (times are not checked: they are the benchmark's to measure)."""

from __future__ import annotations

from bench import tier_costs


def test_the_smoke_run_reports_every_part(tmp_path):
    results = tier_costs.main(["--smoke", "--every-layer", "--out", str(tmp_path)])
    chunks, long, question = results["chunks"], results["long"], results["question"]
    assert chunks["on"]["chunks"] == chunks["off"]["chunks"] > 0 and chunks["tiered_chunks"] > 0
    assert long["dropped_chunks"] > 0  # the tiers filled, and stayed within their budgets:
    assert 0 < long["max_disk_bytes"] <= 0.5 * 2**20
    assert long["host_bytes"] <= 0.2 * 2**20
    assert question["tier_chunks"] >= 300
    assert [(c["recall_tokens"], c["every_layer"]) for c in question["recall"]] == [
        (60, False), (60, True), (120, False), (120, True)]
    assert all(c["recalled_chunks"] >= 1 for c in question["recall"])
    assert all(c["from_disk"] >= 1 and c["cold_disk_ms"] > 0 for c in question["recall"]
               if not c["every_layer"])
    assert "The second tier's costs" in (tmp_path / "tier_costs.md").read_text()
