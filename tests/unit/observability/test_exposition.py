"""The shared text exposition: histogram buckets are cumulative, label values escaped, constant labels on every series."""

from __future__ import annotations

from stack.common.metrics import Counter, Histogram, render_gauges


def test_histogram_buckets_are_cumulative_and_count_is_the_inf_bucket() -> None:
    """Observations land in their bucket; rendered buckets add up; _count equals le="+Inf"; _sum is the total."""
    h = Histogram("x_seconds", "help", (0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        h.observe(value)
    text = "".join(h.render())
    assert 'x_seconds_bucket{le="0.1"} 2\n' in text  # le is inclusive: 0.1 counts in the 0.1 bucket
    assert 'x_seconds_bucket{le="1"} 3\n' in text
    assert 'x_seconds_bucket{le="+Inf"} 4\n' in text
    assert "x_seconds_count 4\n" in text and "x_seconds_sum 3.65\n" in text


def test_constant_labels_join_every_series_sorted() -> None:
    """vLLM-style model_name/engine labels are added to each series, with the observation's own labels."""
    c = Counter("vllm:request_success_total", "help", {"model_name": "m", "engine": "0"})
    c.inc(finished_reason="stop")
    assert 'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 1\n' in "".join(c.render())


def test_label_values_are_escaped() -> None:
    """Backslash, double quote and newline in a label value are escaped as the text format requires."""
    c = Counter("c_total", "help")
    c.inc(key_name='a"b\\c\nd')
    assert 'c_total{key_name="a\\"b\\\\c\\nd"} 1\n' in "".join(c.render())


def test_gauges_are_grouped_by_name_with_one_type_line() -> None:
    """Two collectors yielding the same gauge name give one HELP/TYPE header and both samples."""
    text = "".join(render_gauges({"g": "a gauge"}, [lambda: [("g", {"role": "p"}, 1)], lambda: [("g", {"role": "d"}, 0.5)]]))
    assert text == '# HELP g a gauge\n# TYPE g gauge\ng{role="p"} 1\ng{role="d"} 0.5\n'
