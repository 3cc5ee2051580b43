"""experiments/serving_bench.py's statistics on synthetic data: the time to first token and
the inter-token gaps of a stream, and the p50/p95 of a run (no server, no model)."""
import importlib.util
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
EXPERIMENTS = os.path.join(os.path.dirname(HERE), "experiments")
sys.path.insert(0, EXPERIMENTS)
_spec = importlib.util.spec_from_file_location(
    "serving_bench", os.path.join(EXPERIMENTS, "serving_bench.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def chunk(text, usage=None):
    obj = {"choices": [{"index": 0, "text": text, "finish_reason": None}]}
    if usage is not None:
        obj["usage"] = {"completion_tokens": usage}
    return obj


def test_stream_timing_counts_only_pieces_with_text():
    # sent at 10.0; an empty first event (a token inside a UTF-8 character), then pieces at
    # 10.5, 10.7, 11.0, a finish event without text, and the usage event with no choices
    events = [(10.2, chunk("")), (10.5, chunk("a")), (10.7, chunk("b")), (11.0, chunk("c")),
              (11.1, chunk("")), (11.2, {"choices": [], "usage": {"completion_tokens": 4}})]
    got = bench.stream_timing(10.0, events)
    assert got["tokens"] == 4
    assert got["ttft_s"] == pytest.approx(0.5)
    assert got["itl_s"] == pytest.approx([0.2, 0.3])
    # no usage in the stream (llama-server's): tokens None, the caller knows them
    assert bench.stream_timing(0.0, [(1.0, chunk("x"))]) == {"tokens": None, "ttft_s": 1.0,
                                                              "itl_s": []}
    with pytest.raises(RuntimeError, match="without any text"):
        bench.stream_timing(0.0, [(1.0, chunk(""))])


def test_p50_p95_and_the_run_summary():
    assert bench.p50_p95([]) == (None, None)
    # 1..20: the median between 10 and 11; the 95th percentile at rank 0.95 * 19 = 18.05
    assert bench.p50_p95(list(range(20, 0, -1))) == pytest.approx((10.5, 19.05))
    rows = [{"start_s": 0.0, "end_s": 2.0, "tokens": 8, "ttft_s": 0.5,
             "itl_s": [0.1, 0.1, 0.3]},
            {"start_s": 1.0, "end_s": 5.0, "tokens": 8, "ttft_s": 1.5,
             "itl_s": [0.2, 0.4]}]
    s = bench.summary(rows, wall=4.0)
    assert s["tokens_per_s"] == pytest.approx(4.0)
    assert (s["p50_s"], s["p95_s"]) == pytest.approx((3.0, 3.9))       # latencies 2 and 4
    assert (s["ttft_p50_s"], s["ttft_p95_s"]) == pytest.approx((1.0, 1.45))
    # every gap of every request pooled: 0.1 0.1 0.2 0.3 0.4
    assert (s["itl_p50_ms"], s["itl_p95_ms"]) == pytest.approx((200.0, 380.0))
    # a run that did not stream (generate, transformers): no TTFT, no ITL
    s = bench.summary([{"start_s": 0.0, "end_s": 1.0, "tokens": 3}], wall=1.0)
    assert s["ttft_p50_s"] is None and s["itl_p95_ms"] is None
