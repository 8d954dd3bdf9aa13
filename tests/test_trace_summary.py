"""benchmarks/trace_summary.py: the busy time is the union of device intervals (streams overlap),
and a real torch.profiler trace (CPU here) is read with its annotated ranges."""
import importlib.util
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("trace_summary", ROOT / "benchmarks" / "trace_summary.py")
trace_summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(trace_summary)


def test_busy_time_is_the_union_of_overlapping_intervals():
    # [0,10) and [5,12) overlap -> 12; [20,25) apart -> 5; [21,22) inside it -> nothing more
    assert trace_summary.busy_us([(20, 25), (0, 10), (5, 12), (21, 22)]) == 17
    assert trace_summary.busy_us([]) == 0


def test_summary_of_a_real_profiler_trace(tmp_path):
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            with record_function("megarl-test-range"):
                torch.ones(64, 64) @ torch.ones(64, 64)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    text = trace_summary.summarize(path)
    assert text.startswith("== trace.json: wall ")
    assert "0 kernels" in text                     # CPU: nothing ran on a device
    line = next(ln for ln in text.splitlines() if ln.endswith("megarl-test-range"))
    assert int(line.split()[1]) == 3               # three ranges counted
