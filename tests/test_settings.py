"""The settings pydatacopy reads from the environment (the package's runtime/settings.py), checked
before anything starts: PYDATACOPY_RANKS_PER_GPU, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and
PYDATACOPY_ZERO_COPY_MIN_BYTES (the size grammar and the interfaces, against NVSHMEM itself, are
in test_bad_inputs.py)."""

from __future__ import annotations

import pytest

import pydatacopy
from pydatacopy.runtime import settings as _settings


# ---- PYDATACOPY_RANKS_PER_GPU and the MPS share ----------------------------------------------

@pytest.mark.parametrize("text, value", [("1", 1), ("2", 2), (" 4 ", 4), ("+8", 8), ("64", 64)])
def test_ranks_per_gpu_reads_whole_numbers(text, value):
    assert _settings.ranks_per_gpu({"PYDATACOPY_RANKS_PER_GPU": text}) == value


def test_ranks_per_gpu_defaults_to_one():
    assert _settings.ranks_per_gpu({}) == 1


@pytest.mark.parametrize("text, words", [
    ("0", "out of range"), ("65", "out of range"), ("two", "not a whole number"),
    ("1.5", "not a whole number"), ("", "not a whole number"), ("-2", "not a whole number"),
])
def test_ranks_per_gpu_refuses_the_rest(text, words):
    with pytest.raises(_settings.SettingError, match=words) as info:
        _settings.ranks_per_gpu({"PYDATACOPY_RANKS_PER_GPU": text})
    assert "PYDATACOPY_RANKS_PER_GPU" in str(info.value) and "r // " in str(info.value)


def test_init_checks_the_setting_before_anything_starts():
    problems = dict(_settings.pydatacopy_problems({"PYDATACOPY_RANKS_PER_GPU": "0"}))
    assert "out of range" in problems["PYDATACOPY_RANKS_PER_GPU"]
    with pytest.raises(pydatacopy.Error, match="pydatacopy.init: PYDATACOPY_RANKS_PER_GPU='x'"):
        _settings.check_environment("pydatacopy.init", {"PYDATACOPY_RANKS_PER_GPU": "x"})


@pytest.mark.parametrize("text, value", [(None, None), ("25", 25.0), ("12.5", 12.5), ("100", 100.0)])
def test_mps_thread_percentage(text, value):
    assert _settings.mps_thread_percentage({} if text is None else {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": text}) == value


@pytest.mark.parametrize("text", ["0", "101", "-5", "half", "nan", ""])
def test_mps_thread_percentage_refuses_what_is_no_share(text):
    with pytest.raises(_settings.SettingError, match=r"not a percentage in \(0, 100\]"):
        _settings.mps_thread_percentage({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": text})
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in dict(
        _settings.pydatacopy_problems({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": text}))


# ---- PYDATACOPY_ZERO_COPY_MIN_BYTES -----------------------------------------------------------

@pytest.mark.parametrize("text, ok", [("0", True), ("1048576", True), (" 4096 ", True), ("-1", False),
                                      ("1M", False), ("", False), ("lots", False)])
def test_zero_copy_threshold_is_checked_before_init(text, ok):
    """PYDATACOPY_ZERO_COPY_MIN_BYTES: a whole number of bytes (0 turns zero-copy off); anything
    else is refused with the variable's name before NVSHMEM starts."""
    problems = dict(_settings.pydatacopy_problems({"PYDATACOPY_ZERO_COPY_MIN_BYTES": text}))
    assert ("PYDATACOPY_ZERO_COPY_MIN_BYTES" in problems) == (not ok), problems


# ---- PYDATACOPY_PROGRAMMATIC_LAUNCH -----------------------------------------------------------

@pytest.mark.parametrize("text, ok", [("0", True), ("1", True), ("", True), ("false", False),
                                      ("yes", False), (" 0", False)])
def test_programmatic_launch_switch_is_checked_before_init(text, ok):
    """PYDATACOPY_PROGRAMMATIC_LAUNCH: 0 or 1 only. The core reads anything but 0 as on, so a
    'false' would keep it on: refused with the variable's name before NVSHMEM starts."""
    problems = dict(_settings.pydatacopy_problems({"PYDATACOPY_PROGRAMMATIC_LAUNCH": text}))
    assert ("PYDATACOPY_PROGRAMMATIC_LAUNCH" in problems) == (not ok), problems
