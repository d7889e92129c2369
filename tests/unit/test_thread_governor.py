"""The decode-thread governor's arithmetic (ggufpipe_agent/llama/threads.py):
/proc/stat parsed for the process's cores, other processes' load derived
from it less the CPU time of the process's own group, and the thread count
it gives."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ggufpipe_agent.llama.threads import (
    GroupClock,
    ThreadGovernor,
    _Tracked,
    adaptive_enabled,
    busy_ticks,
    decode_threads,
)

STAT = """cpu  300 0 100 1000 0 0 0 0 0 0
cpu0 100 0 50 500 7 1 2 3 0 0
cpu1 200 0 50 500 0 0 0 0 0 0
intr 12345
"""


def test_busy_ticks_counts_busy_fields_of_the_given_cores() -> None:
    # user nice system irq softirq steal; idle and iowait are not busy
    assert busy_ticks(STAT, [0]) == 100 + 50 + 1 + 2 + 3
    assert busy_ticks(STAT, [0, 1]) == 156 + 250
    assert busy_ticks(STAT, [2]) is None  # a core missing from the text


def test_decode_threads_keeps_the_free_cores() -> None:
    assert decode_threads(2, 2, 0.0) == 2  # quiet: every core
    assert decode_threads(2, 2, 0.3) == 2  # a little noise: still every core
    assert decode_threads(2, 2, 0.6) == 1  # a busy neighbour holds a core
    assert decode_threads(2, 2, 1.9) == 1  # never below one
    assert decode_threads(8, 8, 1.0) == 7
    assert decode_threads(4, 8, 1.0) == 4  # never above what was configured


def test_adaptive_enabled_reads_the_environment() -> None:
    assert adaptive_enabled({})
    assert adaptive_enabled({"GGUFPIPE_ADAPT_THREADS": "1"})
    assert not adaptive_enabled({"GGUFPIPE_ADAPT_THREADS": "0"})
    assert not adaptive_enabled({"GGUFPIPE_ADAPT_THREADS": "off"})


class Machine:
    """Two cores' /proc/stat, this process's CPU seconds and a clock, advanced by hand."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy = [0, 0]  # ticks per core (100 a second)
        self.own = 0.0
        self.calls: list[tuple[int, int, int]] = []

    def advance(self, seconds: float, own_cores: float, other_cores: float) -> None:
        self.now += seconds
        self.own += own_cores * seconds
        total = round((own_cores + other_cores) * seconds * 100)
        self.busy[0] += total // 2
        self.busy[1] += total - total // 2

    def stat(self) -> str:
        return "".join(f"cpu{i} {ticks} 0 0 1000 0 0 0 0\n" for i, ticks in enumerate(self.busy))

    def governor(self) -> ThreadGovernor:
        governor = ThreadGovernor(
            lambda *call: self.calls.append(call),
            read_stat=self.stat,
            own_seconds=lambda: self.own,
            cores=[0, 1],
            clock=lambda: self.now,
        )
        governor._ticks_per_s = 100
        return governor


def test_a_neighbour_takes_a_decode_thread_and_gives_it_back() -> None:
    machine = Machine()
    governor = machine.governor()
    # track() would start the sampling thread; the test samples by hand.
    governor._tracked[0x1000] = _Tracked(0x1000, 2, 2)
    assert governor.sample() is None  # the first sample has nothing to compare with
    machine.advance(1.0, own_cores=1.9, other_cores=0.05)  # quiet: our decode uses both cores
    assert governor.sample() is not None
    assert machine.calls == []  # still 2 threads
    machine.advance(1.0, own_cores=1.2, other_cores=0.8)  # a busy loop beside us
    governor.sample()
    assert machine.calls == [(0x1000, 1, 2)]  # decode on one thread, prompts keep both
    machine.advance(1.0, own_cores=1.0, other_cores=1.0)
    governor.sample()
    assert len(machine.calls) == 1  # unchanged: no call
    machine.advance(1.0, own_cores=1.0, other_cores=0.0)  # the neighbour is gone
    governor.sample()
    assert machine.calls[-1] == (0x1000, 2, 2)
    governor.untrack(0x1000)
    machine.advance(1.0, own_cores=0.5, other_cores=1.0)
    governor.sample()
    assert len(machine.calls) == 2  # an untracked context is never touched


def test_without_proc_stat_nothing_changes() -> None:
    def missing() -> str:
        raise OSError("no /proc/stat")

    governor = ThreadGovernor(lambda *call: None, read_stat=missing, cores=[0, 1])
    assert governor.sample() is None
    assert governor._last is None


def write_stat(proc: Path, pid: int, group: int, utime: int, stime: int) -> None:
    (proc / str(pid)).mkdir(exist_ok=True)
    # state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime ...
    fields = ["S", "1", str(group), "1", "0", "-1", "0", "0", "0", "0", "0", str(utime), str(stime), "0", "0"]
    (proc / str(pid) / "stat").write_text(f"{pid} (python3 -m a b) " + " ".join(fields) + "\n")


def test_group_clock_counts_the_process_group_not_its_neighbours(tmp_path: Path) -> None:
    group = os.getpgrp()
    write_stat(tmp_path, 10, group, 100, 0)  # this agent
    write_stat(tmp_path, 11, group, 50, 50)  # another local stage's agent
    write_stat(tmp_path, 12, group + 1, 500, 0)  # a neighbour: another group
    clock = GroupClock(str(tmp_path), rescan=100)
    clock.ticks_per_s = 100
    assert clock() == 0.0  # first read: the members' baselines
    assert clock.members == {10, 11}
    write_stat(tmp_path, 10, group, 150, 10)
    write_stat(tmp_path, 11, group, 70, 50)
    write_stat(tmp_path, 12, group + 1, 900, 0)
    assert clock() == pytest.approx((60 + 20) / 100)
    (tmp_path / "11" / "stat").unlink()  # that agent ended
    write_stat(tmp_path, 10, group, 250, 10)
    assert clock() == pytest.approx((80 + 100) / 100)
