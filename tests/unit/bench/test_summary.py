"""stack.bench.summary: per-engine tables over repeats — max goodput at SLO, P99s at a common load, ratios to the best
colocated arm with "no difference", the goals, and doctor advise's verdict next to the measured winner."""

from __future__ import annotations

from stack.bench import summary

POINTS = (1.0, 2.0, 4.0)


def run(arm: str, repeat: int, point: float, attained: float, goodput: float, ttft: float = 100.0, itl: float = 40.0,
        verdict: str = "balanced") -> dict:
    return {"stack": arm, "repeat": repeat, "sweep_point": point, "slo_attainment": attained, "request_goodput": goodput,
            "completed": 4,
            "p99_ttft_ms": ttft, "p99_tpot_ms": itl, "p99_itl_ms": itl, "advise": {"verdict": verdict}}


def experiment() -> list[dict]:
    """3 repeats. colocated fails its SLOs at 4; colocated-x2 and disaggregated serve 4 (goodput ≈ 4 both, PD's
    ratio 0.95–1.05×); at 2, PD's TTFT P99 is 0.4–0.6× x2's and its ITL P99 0.25×; advise calls PD prefill-bound at 4
    in two repeats of three."""
    runs = []
    for r in range(3):
        runs += [run("colocated", r, 1, 1.0, 1.0), run("colocated", r, 2, 1.0, 2.0, ttft=300.0),
                 run("colocated", r, 4, 0.5, 2.0)]
        runs += [run("colocated-x2", r, p, 1.0, p) for p in POINTS]
        pd_good = (4.2, 3.8, 4.1)[r]
        runs += [run("disaggregated", r, 1, 1.0, 1.0, itl=10.0), run("disaggregated", r, 2, 1.0, 2.0, ttft=(40.0, 50.0, 60.0)[r], itl=10.0),
                 run("disaggregated", r, 4, 1.0, pd_good, itl=10.0, verdict="more_prefill" if r < 2 else "balanced")]
    return runs


def rows(text: str) -> dict[str, str]:
    return {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}


def test_common_load_is_the_highest_every_arm_served_within_its_slos() -> None:
    """colocated misses its SLOs at 4, so the P99s are compared at 2; if one arm fails everywhere, at the lowest point."""
    runs = experiment()
    assert summary.common_load(runs, ["colocated", "colocated-x2", "disaggregated"], 0.9) == 2.0
    assert summary.common_load(runs, ["colocated-x2", "disaggregated"], 0.9) == 4.0
    failing = [run("a", 0, p, 0.1, 0.1) for p in POINTS] + [run("b", 0, p, 1.0, p) for p in POINTS]
    assert summary.common_load(failing, ["a", "b"], 0.9) == 1.0


def test_arm_table_gives_median_and_range_per_figure() -> None:
    """Each arm's max goodput at SLO, knee and P99s at the common load as median [min–max] over the repeats."""
    runs = experiment()
    figs = summary.figures(runs, 0.9, 2.0)
    table = rows(summary.arm_table(figs, ["colocated", "colocated-x2", "disaggregated"], "req/s"))
    assert table["colocated"] == "| colocated | 2.000 [2.000–2.000] | 2.00 [2.00–2.00] | 300.0 [300.0–300.0] | 40.0 [40.0–40.0] | 40.0 [40.0–40.0] |"
    assert table["disaggregated"].startswith("| disaggregated | 4.100 [3.800–4.200] † | 4.00 [4.00–4.00] † | 50.0 [40.0–60.0] |")
    assert summary.best_colocated(figs, list(figs)) == "colocated-x2"


def test_ratios_are_paired_by_repeat_and_a_range_across_one_is_no_difference() -> None:
    """PD against colocated-x2: goodput 0.95–1.05× is no difference, TTFT P99 0.40–0.60×, ITL P99 0.25×; the goals
    say met, missed, or that the range straddles the goal."""
    figs = summary.figures(experiment(), 0.9, 2.0)
    ratios = rows(summary.ratio_table(figs, ["colocated", "colocated-x2", "disaggregated"], "colocated-x2"))
    assert "colocated-x2" not in ratios  # the baseline has no row of its own
    assert ratios["disaggregated"] == ("| disaggregated | no difference [0.95–1.05×] | 0.50× [0.40–0.60] | "
                                      "0.25× [0.25–0.25] | 0.25× [0.25–0.25] |")
    goals = summary.goal_lines(figs, "colocated-x2", "disaggregated")
    assert goals[0].endswith("not shown (the range straddles the goal)")  # TTFT 0.40–0.60 against ≤ 0.5
    assert goals[1].endswith("(goal <= 0.5×): met")  # ITL
    assert goals[2].endswith("(goal >= 1.5×): missed")  # goodput ~1.0


def test_advice_table_sets_the_doctors_verdict_next_to_the_measured_winner() -> None:
    """At 4 the winner is "no difference" between PD and x2 (ratio range crosses 1); advise said more_prefill in 2 of 3
    repeats for PD; at 2 every arm served the same goodput."""
    table = rows(summary.advice_table(experiment(), ["colocated", "colocated-x2", "disaggregated"], "req/s"))
    assert table["4"] == ("| 4 | no difference (disaggregated ≈ colocated-x2) | balanced (3/3) | balanced (3/3) | "
                          "more_prefill (2/3) |")
    assert table["2"].startswith("| 2 | no difference")


def test_sections_are_per_engine() -> None:
    """vllm: arms get their own section and their own best colocated arm; an engine without arms gets none."""
    runs = [{**r, "stack": "vllm:" + r["stack"]} for r in experiment()]
    text = "\n".join(summary.engine_section(runs, "vllm", 0.9, "req/s"))
    assert text.startswith("## vllm") and "best colocated arm (vllm:colocated-x2)" in text
    assert "Goals for vllm:disaggregated against vllm:colocated-x2:" in text
    assert summary.engine_section(runs, "numpy", 0.9, "req/s") == []
    assert summary.shape_of("vllm:colocated-x2:cache@0/1") == "colocated-x2" and summary.engine_of("colocated") == "numpy"


def test_an_arm_whose_ladder_ended_before_its_knee_is_marked_a_lower_bound() -> None:
    """colocated-x2 met its SLOs at every point in every repeat: its knee and max goodput carry † and the note says
    in how many repeats; colocated, which failed at 4, carries none."""
    figs = summary.figures(experiment(), 0.9, 2.0)
    table = summary.arm_table(figs, ["colocated", "colocated-x2"], "req/s")
    lines = rows(table)
    assert lines["colocated-x2"].startswith("| colocated-x2 | 4.000 [4.000–4.000] † | 4.00 [4.00–4.00] † |")
    assert "†" not in lines["colocated"]
    assert "(colocated-x2 (3 of 3)): that knee and max goodput are lower bounds; extend --sweep." in table


def test_an_arm_that_completed_nothing_has_no_latencies_and_loses() -> None:
    """Every request of PD failed at the common load: its P99s are "–" (not vLLM's 0 ms, which would read as a 0.00×
    win), its goals are not measured, and the arm that served is the winner there."""
    runs = [run("colocated", r, 1, 1.0, 0.97) for r in range(2)]
    runs += [{**run("disaggregated", r, 1, 0.0, 0.0, ttft=0.0, itl=0.0), "completed": 0} for r in range(2)]
    arms = ["colocated", "disaggregated"]
    figs = summary.figures(runs, 0.9, 1.0)
    assert rows(summary.arm_table(figs, arms, "req/s"))["disaggregated"].endswith("| – | – | – |")
    assert summary.goal_lines(figs, "colocated", "disaggregated")[:2] == ["- TTFT P99: not measured", "- ITL P99: not measured"]
    assert rows(summary.advice_table(runs, arms, "req/s"))["1"].startswith("| 1 | colocated |")
