"""Each rank's heartbeat, and the line that names a rank which stopped answering.

Every interval a daemon thread writes this rank's counter, `megadomino/heartbeat/<rank>`, to the
rendezvous store and reads every peer's. A peer whose counter has not moved for `stale_after` has
stopped answering (killed, frozen, its node gone): a second thread prints one line naming it,
flushes, and ends this rank with status 1 (`os._exit`: the main thread may be blocked inside
NCCL, where no exception ever reaches it, and exit handlers would wait on that collective).
Without it, NCCL's watchdog ends the process at the timeout with no line naming the stalled rank,
and gloo's timeout cannot tell a stopped rank from a live one that entered the collective later.

Timing, from --distributed-timeout-minutes T, in seconds:
- `interval` = T/12 clamped to [0.5, 10]: a write and one read of every peer's counter per
  interval, so the store serves 2 requests per rank per interval whatever the world size.
- `stale_after` = max(T/2, 6 intervals). NCCL's watchdog ends a rank T after it *enqueued* the
  collective its peer never joins, and the peer may have stopped after that moment (the host runs
  ahead of the GPU); half of T leaves the other half for that gap. The floor of 6 intervals keeps
  a tiny T from naming a peer that is a round or two late on a loaded host.
- A rank ends at most `stale_after` + 2 intervals (plus a store round trip) after a peer stopped:
  its last change is seen within an interval, and the watch looks every interval. When gloo's
  timeout comes first (the peer stayed alive elsewhere for half of T before it stopped, or never
  stopped), launch asks `after_timeout` for the line: it names no live rank, and says that every
  rank still beats within about 2 intervals when that is so.

Only a rank's *process* is watched, not its main thread: the counter moves while the main thread
computes, saves a checkpoint, compiles or waits in a collective, so long legitimate work never
looks like a stall. The caveat is the GIL: all of those release it or share it every few
milliseconds, but a C extension call that held it for `stale_after` would stop this rank's counter
and its peers would end the job naming it.

The store is the one at MASTER_ADDR:MASTER_PORT (hosted by rank 0, or by torchrun's agent on rank
0's node), reached through a client of the heartbeat's own: the default store's client serves the
main thread's process-group calls and is not shared across threads. A store that gives no answer
for `stale_after` is named instead of the ranks. A request to a frozen store host never times out
(only the wait for a key does), so the thread that reads may block for good: the thread that
judges only reads what it recorded. One line per rank: whichever speaks first, that thread or
launch's handler of gloo's timeout, takes it; the other stays silent.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time

import torch.distributed as dist


def heartbeat_key(rank: int) -> str:
    """The store key holding `rank`'s counter."""
    return f"megadomino/heartbeat/{rank}"


def rank_list(ranks: list[int]) -> str:
    """'rank 3', 'ranks 1, 5' or 'ranks 8-15': runs of consecutive ranks as ranges (a dead node
    is usually a run of them)."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    named = ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
    return f"rank{'s' if len(ranks) > 1 else ''} {named}"


class StalledRankError(Exception):
    """Peers never published their first heartbeat, or the store never answered, within the
    timeout of `Heartbeat.start` (the message is the whole line, after `error: `)."""


class Heartbeat:
    """This rank's heartbeat and its watch over every peer's (see the module docstring).

    `start` once, right after the process group exists; `stop` before the process group is
    destroyed. Two daemon threads: `_beat_loop` talks to the store (its client is its own once it
    runs) and may block there for good, since a client's request to a frozen store host never
    times out; `_watch_loop` only reads the view, so it ends the process even then. `_lock`
    guards the view (`_seen`, `_moved_at`, `_answered_at`) and `_said`, the one line per
    process.
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int,
                 timeout_minutes: float):
        self.host, self.port, self.rank = host, port, rank
        self.timeout_minutes = timeout_minutes
        self.interval_s = min(max(timeout_minutes * 60 / 12, 0.5), 10.0)
        self.stale_after_s = max(timeout_minutes * 60 / 2, 6 * self.interval_s)
        self._peers = [peer for peer in range(world_size) if peer != rank]
        self._keys = [heartbeat_key(peer) for peer in self._peers]
        self._store: dist.TCPStore | None = None
        self._beats = 0
        self._seen: dict[int, bytes] = {}
        self._moved_at: dict[int, float] = {}
        self._answered_at = 0.0
        self._said = False
        self._lock = threading.Condition()
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=loop, name=f"megadomino-heartbeat-{what}",
                                          daemon=True)
                         for loop, what in ((self._beat_loop, "beat"),
                                            (self._watch_loop, "watch"))]

    def start(self) -> None:
        """Publish this rank's first beat, wait up to the timeout for every peer's (ranks leave
        init_process_group at different times), then watch in the background. Raises
        StalledRankError naming the peers that never beat."""
        try:
            store = self._connect(datetime.timedelta(minutes=self.timeout_minutes))
            self._beat(store)
        except dist.DistError:
            raise StalledRankError(self._store_line(self.timeout_minutes * 60)) from None
        try:
            store.wait(self._keys)
        except dist.DistError:
            try:
                missing = [peer for peer, key in zip(self._peers, self._keys)
                           if not store.check([key])]
            except dist.DistError:
                raise StalledRankError(self._store_line(self.timeout_minutes * 60)) from None
            raise StalledRankError(
                f"{rank_list(missing)} never started (no heartbeat within "
                f"--distributed-timeout-minutes {self.timeout_minutes:g}); "
                f"ending this rank ({self.rank})") from None
        store.set_timeout(datetime.timedelta(seconds=self.interval_s))
        self._seen = dict(zip(self._peers, store.multi_get(self._keys)))
        self._answered_at = time.monotonic()
        self._moved_at = dict.fromkeys(self._peers, self._answered_at)
        self._store = store
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """End the watch: the threads finish their round and are joined (for at most a few
        intervals: a store round may hang); daemons, they never keep the process alive."""
        self._stopping.set()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=2 * self.interval_s)

    def after_timeout(self) -> str | None:
        """The line for a collective that gloo timed out. A live peer beats again within an
        interval or two; a silent one may have stopped just now. So wait until every peer has
        beaten since the timeout (then every rank is alive and one waits elsewhere: say so), or
        until the watch names the silent ones (it takes the line and ends the process: None),
        for at most `stale_after` + 2 intervals, after which the verdict holds. A live rank that
        entered the collective later is never named; this rank says nothing more."""
        with self._lock:
            timed_out_at = time.monotonic()
            self._lock.wait_for(lambda: self._said or all(
                self._moved_at[peer] > timed_out_at for peer in self._peers),
                timeout=self.stale_after_s + 2 * self.interval_s)
            if self._said:
                return None
            self._said = True
            return self._verdict(time.monotonic()) or (
                f"a collective waited --distributed-timeout-minutes {self.timeout_minutes:g}, "
                f"but every rank's heartbeat still beats: a rank waits elsewhere (a collective "
                f"the others did not call, or a hang in its main thread); ending this rank "
                f"({self.rank})")

    def _connect(self, timeout: datetime.timedelta) -> dist.TCPStore:
        return dist.TCPStore(self.host, self.port, world_size=None, is_master=False,
                             timeout=timeout, wait_for_workers=False)

    def _beat(self, store: dist.TCPStore) -> None:
        self._beats += 1
        store.set(heartbeat_key(self.rank), str(self._beats))

    def _beat_loop(self) -> None:
        """Every interval: this rank's beat, then every peer's counter into the view."""
        store = self._store
        while not self._stopping.wait(self.interval_s):
            try:
                store = store or self._connect(datetime.timedelta(seconds=self.interval_s))
                self._beat(store)
                values = store.multi_get(self._keys)
            except dist.DistError:
                # A late answer to a request that timed out would be read as the next request's:
                # reconnect rather than reuse the connection.
                store = None
                continue
            now = time.monotonic()
            with self._lock:
                self._answered_at = now
                for peer, value in zip(self._peers, values):
                    if value != self._seen[peer]:
                        self._seen[peer], self._moved_at[peer] = value, now
                self._lock.notify_all()

    def _watch_loop(self) -> None:
        """Every interval: end the process, with its one line, if the view shows a stall."""
        while not self._stopping.wait(self.interval_s):
            with self._lock:
                line = self._verdict(time.monotonic())
                if line is None or self._said or self._stopping.is_set():
                    continue
                self._said = True
                # Printed under the lock: a main thread that finds the line taken may return
                # and end the interpreter, which stops daemon threads, before an unlocked print.
                sys.stdout.flush()
                print(f"error: {line}", file=sys.stderr, flush=True)
            os._exit(1)

    def _verdict(self, now: float) -> str | None:
        """The line naming what is stale at `now` (the store, else the peers), or None."""
        if now - self._answered_at >= self.stale_after_s:
            return self._store_line(now - self._answered_at)
        stalled = [peer for peer in self._peers if now - self._moved_at[peer] >= self.stale_after_s]
        if not stalled:
            return None
        silent_s = min(now - self._moved_at[peer] for peer in stalled)
        return (f"{rank_list(stalled)} stopped answering (no heartbeat for {silent_s:.1f} s; "
                f"--distributed-timeout-minutes {self.timeout_minutes:g}); "
                f"ending this rank ({self.rank})")

    def _store_line(self, silent_s: float) -> str:
        return (f"the rendezvous store at {self.host}:{self.port} does not answer (its host, "
                f"rank 0 or its node's launcher, is silent; no answer for {silent_s:.1f} s; "
                f"--distributed-timeout-minutes {self.timeout_minutes:g}); "
                f"ending this rank ({self.rank})")
