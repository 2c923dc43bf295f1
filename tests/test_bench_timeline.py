"""The send/recv timeline tool's trace reading (pydatacopy.bench.timeline), on synthetic Chrome
traces: which events count as the rows' kernels, and the medians it reports."""

from __future__ import annotations

from pydatacopy.bench.timeline import PHASES, kernel_spans, phase_summary, summarize


def _kernel(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_only_the_rows_kernels_count_in_start_order():
    trace = {"traceEvents": [
        _kernel("void pydatacopy::kernels::(anonymous namespace)::chunk_batch_kernel<2>(...)", 30.0, 4.0),
        _kernel("at::native::vectorized_elementwise_kernel", 5.0, 1.0),  # torch's fill: not ours
        _kernel("void pydatacopy::kernels::(anonymous namespace)::copy_kernel(...)", 10.0, 2.0),
        _kernel("chunk_batch_kernel<2>", 20.0, 3.0, cat="cuda_runtime"),  # the launch, not the kernel
        {"ph": "i", "cat": "kernel", "name": "chunk_batch_kernel<2>", "ts": 1.0},  # an instant: no span
    ]}
    assert kernel_spans(trace) == [(10.0, 12.0), (30.0, 34.0)]


def test_the_medians_of_duration_gap_and_period():
    spans = [(0.0, 2.0), (10.0, 13.0), (20.0, 24.0), (31.0, 33.0)]
    assert summarize(spans) == {"kernels": 4, "duration_us": 2.5, "gap_us": 7.0, "period_us": 10.0}


def test_one_kernel_has_no_gap_and_none_has_nothing():
    assert summarize([(5.0, 6.0)]) == {"kernels": 1, "duration_us": 1.0, "gap_us": None, "period_us": None}
    assert summarize([]) == {"kernels": 0, "duration_us": None, "gap_us": None, "period_us": None}


def _record(**at_us) -> list[int]:
    """A launch's stamps, given in us from an origin of 100 us (a stamp of 0 is one not reached)."""
    return [int((at_us[name] + 100) * 1000) if name in at_us else 0 for name in PHASES] + [3, 1]


def test_phase_spans_skip_unreached_stamps_and_measure_between_launches():
    records = [
        _record(entered=0, grid_waited=2, prologue_done=3, op_done=5, loop_left=6, counters_done=6.5, ended=7),
        _record(entered=6, grid_waited=7.5, prologue_done=8, rendezvous=9, op_done=12, loop_left=12, counters_done=13,
                ended=14),
    ]
    out = phase_summary(records)
    assert out["launches"] == 2
    assert out["grid_wait"] == 1.75 and out["prologue"] == 0.75
    assert out["to_rendezvous"] == 1.0 and out["rendezvous_to_done"] == 3.0  # the second launch only
    assert out["prologue_to_done"] == 3.0 and out["entered_to_ended"] == 7.5
    assert out["ended_to_next_entered"] == -1.0 and out["ended_to_next_waited"] == 0.5
    assert out["modes"] == {"no descriptor": 0, "staged": 0, "zero-copy": 0, "low-latency": 2, "copy-engine": 0}


def test_modes_count_each_launch_by_the_path_op_0_took():
    staged, zero_copy = _record(entered=0, ended=1), _record(entered=2, ended=3)
    staged[len(PHASES)], zero_copy[len(PHASES)] = 1, 2
    out = phase_summary([staged, zero_copy, zero_copy])
    assert out["modes"] == {"no descriptor": 0, "staged": 1, "zero-copy": 2, "low-latency": 0, "copy-engine": 0}


def test_no_launch_gives_no_span():
    out = phase_summary([])
    assert out["launches"] == 0 and out["grid_wait"] is None and out["ended_to_next_entered"] is None


def test_handoff_steps_pair_the_ranks_launches_and_skip_messages_without_parts():
    from pydatacopy.bench.timeline import HANDOFF_STEPS, handoff_summary

    # Two zero-copy messages 30 us apart, then a staged one (no parts stamped): not counted.
    sender = [_record(rendezvous=1 + 30 * k, copied=9 + 30 * k, parts_last_final=12 + 30 * k) for k in range(2)]
    sender.append(_record(rendezvous=61))
    receiver = [_record(posted=0.5 + 30 * k, op_done=16 + 30 * k) for k in range(3)]
    out = handoff_summary(sender, receiver)
    assert set(out) == {name for name, _, _ in HANDOFF_STEPS} | {"messages"}
    assert out["messages"] == 2
    assert out["post_to_take"] == 0.5 and out["take_to_block0_copied"] == 8.0
    assert out["block0_copied_to_last_final"] == 3.0 and out["last_final_to_seen"] == 4.0
    assert out["seen_to_next_post"] == 14.5 and out["post_period"] == 30.0
    # Fewer receiver launches than sender ones: the pairs that exist; no message at all: None.
    assert handoff_summary(sender, receiver[:1])["messages"] == 1
    empty = handoff_summary([], [])
    assert empty["messages"] == 0 and empty["post_to_take"] is None
