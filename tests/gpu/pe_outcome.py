"""Failures kept instead of raised, so that every PE goes through the same collective steps
(barriers, setup_send_recv, a fixture's teardown) whatever happened on it: a PE that raised alone
would enter a collective the other PEs never reach, and all would time out, poisoning the rest of
the process. Shared by the GPU tests that run several PEs in step."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch.distributed as dist

import pydatacopy


def fail_on_every_pe(world_size: int, failures: list[str], prefix: str = "", most: int | None = None) -> None:
    """Collective: gather every PE's failures and fail every PE together if any PE has one
    (`most`: list at most that many, then a count)."""
    every: list = [None] * world_size
    dist.all_gather_object(every, list(failures))
    bad = [f"PE {pe}: {failure}" for pe, failed in enumerate(every) for failure in failed]
    if bad:
        shown = bad if most is None else bad[:most]
        more = f"; and {len(bad) - most} more" if most is not None and len(bad) > most else ""
        pytest.fail(prefix + "; ".join(shown) + more, pytrace=False)


def end_step(world_size: int, failures: list[str], timeout: float, prefix: str = "") -> None:
    """The end of a test run in step (the modules' autouse fixtures): every PE's work done, every
    PE here, then the failures any PE kept (`failures`, emptied) fail every PE together, then no
    pending device error."""
    import torch

    torch.cuda.synchronize()
    pydatacopy.barrier(blocking=True, timeout=timeout)
    kept = list(failures)
    failures.clear()
    fail_on_every_pe(world_size, kept, prefix, most=12)
    pydatacopy.check_errors()


class Outcome:
    """This PE's failures, kept; agree() fails every PE together. `timeout_is_failure`: an
    expected error that comes as pydatacopy.TimeoutError fails, whatever its text (a mismatch
    must be told promptly, not after the timeout)."""

    def __init__(self, world, timeout_is_failure: bool = False) -> None:
        self.world_size = world[1]
        self.timeout_is_failure = timeout_is_failure
        self.failures: list[str] = []

    @contextlib.contextmanager
    def check(self, what: str):
        try:
            yield
        except Exception as error:  # AssertionError, pydatacopy.Error and anything else
            self.failures.append(f"{what}: {type(error).__name__}: {error}")

    @contextlib.contextmanager
    def expect_error(self, what: str, pattern: str):
        """Like pytest.raises(pydatacopy.Error, match=pattern), but recorded, not raised."""
        try:
            yield
        except pydatacopy.Error as error:
            if self.timeout_is_failure and isinstance(error, pydatacopy.TimeoutError):
                self.failures.append(f"{what}: timed out instead of a prompt size-mismatch Error: {error}")
            elif not re.search(pattern, str(error)):
                self.failures.append(f"{what}: raised {error!r}, which does not match {pattern!r}")
        except Exception as error:
            self.failures.append(f"{what}: raised {type(error).__name__}: {error}, not "
                                 f"pydatacopy.Error matching {pattern!r}")
        else:
            self.failures.append(f"{what}: did not raise (expected {pattern!r})")

    def agree(self, step: str) -> None:
        """Collective (also a barrier): fail on every PE if any PE failed so far."""
        fail_on_every_pe(self.world_size, self.failures, f"by {step}: ")
