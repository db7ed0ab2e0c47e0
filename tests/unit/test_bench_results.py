"""`make bench` rewrites only its own block of bench/results.md; hand-measured sections stay."""

from __future__ import annotations

from bench.run import BEGIN, END, with_generated_block


def test_a_rerun_replaces_only_the_generated_block() -> None:
    first = with_generated_block("", "old timings")
    edited = first + "\n## Measured by hand\n\na 30-minute demo: 37% -> 98%\n"
    second = with_generated_block(edited, "new timings")
    assert "new timings" in second and "old timings" not in second
    assert second.endswith("## Measured by hand\n\na 30-minute demo: 37% -> 98%\n")
    assert second.count(BEGIN) == second.count(END) == 1


def test_a_file_without_markers_keeps_everything_as_hand_measured() -> None:
    result = with_generated_block("# Benchmark results\n\n### Demo curve\nstep 1: 0.4\n", "timings")
    generated, _, kept = result.partition(END)
    assert "timings" in generated and "Demo curve" not in generated
    assert "Measured by hand" in kept and "step 1: 0.4" in kept
