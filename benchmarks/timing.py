"""How a call is timed: interleaved turns, the best turn of all, an idle gap before each turn.

The timed calls of a case take turns round-robin (ours, torch, numpy, copy, ours, ...), each call
at each of its thread counts.  A turn is a loop of k back-to-back calls, k calibrated so that the
loop lasts about `loop_seconds`, started after TURN_GAP_SECONDS idle; the time per call is the
best turn's.  With fresh arguments every call of a turn gets arrays of its own, copied before the
turn starts, so none is warm from an earlier call; what a call allocates itself (its result) is
freed right after it, in either mode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np


@dataclass(frozen=True)
class Settings:
    rounds: int  # passes over the whole list of cases
    repetitions: int  # turns of each timed call per case and round
    loop_seconds: float  # how long one turn's loop of calls lasts


# A round goes through every case once; each case gets `repetitions` turns per round.  The
# machine is shared: another tenant's burst of memory traffic can last seconds and slow every
# turn of a case, whoever's turn it is.  Spreading a case's turns over rounds a minute or so
# apart lets its best turn come from a quiet moment, for ours and torch alike.
FULL_SETTINGS = Settings(rounds=3, repetitions=6, loop_seconds=0.030)
QUICK_SETTINGS = Settings(rounds=1, repetitions=3, loop_seconds=0.002)

# Idle time before each turn.  After a parallel region torch's OpenMP workers (libgomp) keep
# spinning for milliseconds, and on 2 cores a spinning worker takes a core from whatever runs
# next: measured on an AMD EPYC, ours right after torch's turn was 1.2x slower than ours after
# a pause (1024x1024 float64 backward).  With the gap each turn starts on an idle machine;
# within its own turn torch still gets the benefit of its spinning workers.
TURN_GAP_SECONDS = 0.02

# With fresh arguments all the arrays of a turn's calls exist at once; these bound what a turn holds.
FRESH_MAX_CALLS = 1000
FRESH_MAX_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Timed:
    """One call to time: call(*args), the function under test called directly, and how to set its
    thread count when it has one."""

    call: Callable[..., Any]
    args: tuple[Any, ...]
    set_num_threads: Callable[[int], None] | None = None  # None: the call is single-threaded
    threads: int = 1  # what set_num_threads gets before each turn of this call

    @property
    def threaded(self):
        return self.set_num_threads is not None

    def at(self, threads):
        """The same call run with `threads` threads."""
        return dataclasses.replace(self, threads=threads)

    def use_threads(self):
        if self.set_num_threads is not None:
            self.set_num_threads(self.threads)

    def run(self):
        """One untimed call at this call's thread count: its result."""
        self.use_threads()
        return self.call(*self.args)


# ----------------------------------------------------------------------------- thread settings


def usable_cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def default_thread_counts():
    """One thread, and every usable core."""
    return tuple(sorted({1, usable_cores()}))


def threads_text(threads):
    return "1 thread" if threads == 1 else f"{threads} threads"


# ----------------------------------------------------------------------------- fresh arguments


def fresh_argument(value):
    """A new copy of an array or torch tensor argument (an input, or a buffer the call writes
    into); any other argument (shapes, eps) as it is."""
    if isinstance(value, np.ndarray):
        return value.copy()
    if hasattr(value, "clone"):  # a torch tensor
        return value.clone()
    return value


def fresh_arguments(timed):
    return tuple(fresh_argument(value) for value in timed.args)


def fresh_call_count(timed, calls):
    """How many of `calls` one fresh turn makes, within FRESH_MAX_CALLS and FRESH_MAX_BYTES."""
    argument_bytes = sum(getattr(value, "nbytes", 0) for value in timed.args)
    by_memory = FRESH_MAX_BYTES // max(1, argument_bytes)
    return max(1, min(calls, FRESH_MAX_CALLS, by_memory))


# ----------------------------------------------------------------------------- timed loops


@contextlib.contextmanager
def garbage_collector_paused():
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def time_loop(timed, calls):
    """Seconds taken by `calls` back-to-back calls on the same arguments."""
    call, args = timed.call, timed.args
    with garbage_collector_paused():
        start = time.perf_counter()
        for _ in range(calls):
            call(*args)
        return time.perf_counter() - start


def time_fresh_loop(timed, argument_sets):
    """Seconds taken by one call on each set of arguments."""
    call = timed.call
    with garbage_collector_paused():
        start = time.perf_counter()
        for args in argument_sets:
            call(*args)
        return time.perf_counter() - start


def calibrate_loop_calls(timed, loop_seconds):
    """Number of calls that makes one timed loop last about loop_seconds.

    Each trial loop is timed three times and the fastest counts, so one preemption (the machine
    is shared) cannot stop the doubling early and leave every timed loop a single call long.
    """
    timed.run()  # warm-up

    def fastest_loop(calls):
        return min(time_loop(timed, calls) for _ in range(3))

    calls = 1
    elapsed = fastest_loop(calls)
    while elapsed < loop_seconds / 10 and calls < 10_000_000:
        calls *= 2
        elapsed = fastest_loop(calls)
    return max(1, round(calls * loop_seconds / elapsed))


def time_turn(timed, calls, fresh):
    """Seconds per call in one turn: its thread count set and its fresh arguments made, then the
    idle gap, then the timed loop."""
    timed.use_threads()
    if not fresh:
        time.sleep(TURN_GAP_SECONDS)
        return time_loop(timed, calls) / calls
    argument_sets = [fresh_arguments(timed) for _ in range(calls)]
    time.sleep(TURN_GAP_SECONDS)
    return time_fresh_loop(timed, argument_sets) / calls


def best_times_round_robin(functions, settings, fresh=False):
    """Best seconds per call of each Timed in `functions` (name -> Timed), taking turns round-robin."""
    calls = {}
    for name, timed in functions.items():
        timed.use_threads()
        loop_calls = calibrate_loop_calls(timed, settings.loop_seconds)
        calls[name] = fresh_call_count(timed, loop_calls) if fresh else loop_calls
    best = dict.fromkeys(functions, math.inf)
    for _ in range(settings.repetitions):
        for name, timed in functions.items():
            best[name] = min(best[name], time_turn(timed, calls[name], fresh))
    return best
