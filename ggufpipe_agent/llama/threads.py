"""How many threads a stage decodes with while other processes hold cores.

llama.cpp's CPU backend runs each graph on a team of ``n_threads`` threads
that meet at a barrier after every node (hundreds a token). When another
process keeps one of the cores busy, the team member that shares its core
is preempted for whole time slices and every barrier waits for it: the
bundled example (3 stages, 2 threads each, 2 cores) decoded 0.43 of one
llama.cpp thread beside one busy loop, 1.01 with this governor
(docs/bench-busy.md). How long idle threads spin (``GOMP_SPINCOUNT``, 1k to
300k) does not change that; the team's size does.

So a stage whose ``threads`` the inventory leaves at 0 decodes with the
cores that are free: :class:`ThreadGovernor` samples, about twice a second,
the CPU time the process's cores spent busy (``/proc/stat``) less that of
the processes of its own process group (``/proc/PID/stat``: this agent,
the orchestrator that started it and the other local stages' agents, whose
turns are the pipeline's own work, not a neighbour's; a shell puts each job
in a group of its own) and gives every tracked context
``cores - round(others)`` decode threads (at least 1, at most its
configured count), through ``llama_set_n_threads``. A prompt's batches keep
every core (``n_threads_batch``): their nodes are long enough that a slow
member costs less than the missing core (prefill of ~590 tokens beside the
busy loop: 3.5 s with 2 threads, 4.3 s with 1). A quiet machine keeps every
core for decode too, and a host whose ``threads`` is given keeps it.

``llama_set_n_threads`` only stores two integers that the next
``llama_decode`` reads; the sampler thread calls it between two decodes or
during one (that one keeps the count it started with). Where ``/proc/stat``
is missing (not Linux) nothing is sampled and the counts stay as configured.
``GGUFPIPE_ADAPT_THREADS=0`` turns the governor off (to measure it).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("ggufpipe.agent")

#: Seconds between two samples of the machine's load.
INTERVAL = 0.5
#: Where Linux counts each core's time.
PROC_STAT = "/proc/stat"
#: /proc/stat's busy fields: user nice system (idle iowait) irq softirq steal.
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)


def adaptive_enabled(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Whether the governor runs (``GGUFPIPE_ADAPT_THREADS``, default on)."""
    return environ.get("GGUFPIPE_ADAPT_THREADS", "1").strip() not in ("0", "off", "no", "false")


def usable_cores() -> list[int]:
    """The cores this process may run on (its affinity), or ``range(cpu_count)``."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def busy_ticks(stat_text: str, cores: list[int]) -> int | None:
    """The clock ticks (USER_HZ) ``cores`` have spent busy, from /proc/stat's
    text; None if a core's line is missing."""
    wanted = {f"cpu{core}" for core in cores}
    total, seen = 0, 0
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if name in wanted:
            fields = [int(value) for value in rest.split()]
            total += sum(fields[i] for i in _BUSY_FIELDS if i < len(fields))
            seen += 1
    return total if seen == len(wanted) else None


def decode_threads(configured: int, cores: int, others: float) -> int:
    """Decode threads for a context configured with ``configured`` when other
    processes use ``others`` cores' worth of ``cores``: the free cores
    (half a core's use counts as one), at least 1, at most ``configured``."""
    free = cores - int(others + 0.5)
    return max(1, min(configured, free))


@dataclass
class _Tracked:
    context: int  # llama_context *
    configured: int  # its n_threads when free (= n_threads_batch)
    current: int


class ThreadGovernor:
    """Gives tracked llama.cpp contexts as many decode threads as cores are
    free of other processes' work (see the module's docstring)."""

    def __init__(
        self,
        set_threads: Callable[[int, int, int], None],
        *,
        read_stat: Callable[[], str] | None = None,
        own_seconds: Callable[[], float] | None = None,
        cores: list[int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``set_threads(context, n_threads, n_threads_batch)``; the readers
        default to /proc/stat and the process group's CPU time (a test passes its own)."""
        self._set = set_threads
        self._read_stat = read_stat or _read_proc_stat
        self._own = own_seconds or GroupClock()
        self._cores = cores if cores is not None else usable_cores()
        self._clock = clock
        self._ticks_per_s = _ticks_per_second()
        self._lock = threading.Lock()
        self._tracked: dict[int, _Tracked] = {}
        self._last: tuple[float, int, float] | None = None  # (when, busy ticks, own seconds)
        self._thread: threading.Thread | None = None
        self.others = 0.0  # other processes' cores at the last sample

    def track(self, context: int, threads: int) -> None:
        """Adapt ``context``'s decode threads (configured: ``threads``)."""
        if threads <= 1 or not context:
            return
        with self._lock:
            self._tracked[context] = _Tracked(context, threads, threads)
            start = self._thread is None
            if start:
                self._thread = threading.Thread(target=self._loop, name="thread-governor", daemon=True)
        if start:
            assert self._thread is not None
            self._thread.start()

    def untrack(self, context: int) -> None:
        """Before the context is freed: never touch it again."""
        with self._lock:
            self._tracked.pop(context, None)

    def sample(self) -> float | None:
        """One sample: other processes' cores since the last, applied to every
        tracked context; None at the first sample or without /proc/stat."""
        try:
            busy = busy_ticks(self._read_stat(), self._cores)
        except OSError:
            busy = None
        if busy is None:
            return None
        now, own = self._clock(), self._own()
        last, self._last = self._last, (now, busy, own)
        if last is None or now <= last[0]:
            return None
        elapsed = now - last[0]
        busy_cores = (busy - last[1]) / self._ticks_per_s / elapsed
        own_cores = (own - last[2]) / elapsed
        self.others = max(0.0, busy_cores - own_cores)
        with self._lock:
            for entry in self._tracked.values():
                wanted = decode_threads(entry.configured, len(self._cores), self.others)
                if wanted != entry.current:
                    self._set(entry.context, wanted, entry.configured)
                    log.debug("decode threads %d -> %d (others: %.2f)", entry.current, wanted, self.others)
                    entry.current = wanted
        return self.others

    def _loop(self) -> None:
        while True:
            if self.sample() is None and self._last is None:
                return  # no /proc/stat: nothing to adapt to
            time.sleep(INTERVAL)


def _read_proc_stat() -> str:
    with open(PROC_STAT, encoding="ascii") as stat:
        return stat.read()


class GroupClock:
    """The CPU seconds the processes of this process's group (``getpgrp``)
    have used since they were first seen: the members are found in /proc
    every ``rescan`` reads and read at each; one that ends takes its share
    with it. Without /proc, this process's own (``os.times``)."""

    def __init__(self, proc: str = "/proc", rescan: int = 10) -> None:
        self.proc = proc
        self.rescan = rescan
        self.group = os.getpgrp()
        self.members: set[int] = set()
        self.last: dict[int, int] = {}  # pid -> its utime + stime (ticks) at the last read
        self.total = 0  # ticks of the members since first seen
        self.reads = 0
        self.ticks_per_s = _ticks_per_second()

    def __call__(self) -> float:
        if self.reads % self.rescan == 0:
            self.members = self._find_members()
        self.reads += 1
        if not self.members:
            times = os.times()
            return times.user + times.system
        now: dict[int, int] = {}
        for pid in self.members:
            fields = _stat_fields(f"{self.proc}/{pid}/stat")
            if fields is None or int(fields[2]) != self.group:
                continue  # ended (or its pid reused)
            ticks = int(fields[11]) + int(fields[12])
            now[pid] = ticks
            if pid in self.last:
                self.total += max(0, ticks - self.last[pid])
        self.last = now
        return self.total / self.ticks_per_s

    def _find_members(self) -> set[int]:
        try:
            pids = [int(name) for name in os.listdir(self.proc) if name.isdigit()]
        except OSError:
            return set()
        members = set()
        for pid in pids:
            fields = _stat_fields(f"{self.proc}/{pid}/stat")
            if fields is not None and int(fields[2]) == self.group:
                members.add(pid)
        return members


def _stat_fields(path: str) -> list[str] | None:
    """/proc/PID/stat's fields after the command's name (state first), or None."""
    try:
        with open(path, encoding="ascii", errors="replace") as stat:
            text = stat.read()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()
    return fields if len(fields) > 12 else None


def _ticks_per_second() -> int:
    try:
        return int(os.sysconf("SC_CLK_TCK"))
    except (AttributeError, ValueError, OSError):
        return 100


_governor: ThreadGovernor | None = None
_governor_lock = threading.Lock()


def governor() -> ThreadGovernor | None:
    """The process's governor (None when ``GGUFPIPE_ADAPT_THREADS=0``)."""
    global _governor
    if not adaptive_enabled():
        return None
    with _governor_lock:
        if _governor is None:
            import llama_cpp

            def set_threads(context: int, n_threads: int, n_threads_batch: int) -> None:
                llama_cpp.llama_set_n_threads(context, n_threads, n_threads_batch)

            _governor = ThreadGovernor(set_threads)
        return _governor
