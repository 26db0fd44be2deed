"""The shared store of decoupled training (the paper's Fig. 3): the file layer under it.

mgrpo.py says what the two roles exchange (`RemoteSub`, `serve_sub` and the record checks); this module
only moves JSON records between two processes safely: atomic writes, checked keys, size limits, a lock
per role and heartbeats. Nothing here knows about agents or M-GRPO, so it can be copied on its own.
"""
import fcntl
import json
import os
import re
import secrets
import threading
import time


class StoreError(RuntimeError):
    """The store or the peer failed; the message names the store, the record and what to do."""


class FileStore:
    """The shared store: one small JSON file per record under <root>/<run_id>/.

    Writes are atomic: a temporary file created exclusively (never through a symlink) and locked by
    its writer until it is fsynced and renamed into place; a failed write removes it. Keys are
    checked, so no record lands outside the directory; a record that is no JSON object, or a
    symlink, is an error that names it; a lock keeps a second process of a role off the store until
    the first closes it. Each role writes a heartbeat with a counter every second, which the reader
    times on its own clock (the machines' clocks need not agree): a peer whose counter stood still
    for `timeout` s is gone. A wait for one record of a live peer that is in the schedule ends after
    `progress_timeout` s (0: never; -1, auto: AUTO_FACTOR times the slowest phase this role has seen,
    at least AUTO_FLOOR s); a peer that is still starting (loading, its cold start: what it does is
    in its heartbeat, `doing`) gets `progress_timeout` s too, or, auto, START_LIMIT s. Both raise
    StoreError.
    """
    KEY, MAX_BYTES = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}"), 64 * 2 ** 20
    AUTO_FLOOR, AUTO_FACTOR, START_LIMIT = 1800.0, 10.0, 7200.0

    def __init__(self, root, run_id, role, timeout=60.0, progress_timeout=-1.0):
        self.dir, self.role = os.path.join(root, self.check(run_id)), role
        self.peer = {"main": "sub", "sub": "main"}.get(role)
        os.makedirs(self.dir, exist_ok=True)
        self.timeout, self.progress_timeout = timeout, progress_timeout
        self.io_time = 0.0     # seconds spent reading and writing records, not waiting
        self.phase = -1        # published in the heartbeat: the schedule position worked on (-1: starting)
        self.saved = 0         # published too: the schedule position of the last checkpoint
        self.doing = "starting"  # published too, while phase is -1: what this role does before its schedule
        self.slowest = 0.0     # the longest phase this role has seen, in seconds
        self.phase_start = time.monotonic()
        self.beat_error = None  # set by the heartbeat thread when its writes keep failing
        self.seen = (None, time.monotonic())  # the peer's heartbeat counter, and when it last moved
        self.peer_phase = (None, time.monotonic())  # the peer's published phase, and since when
        self.stop, self.lock, self.beater = threading.Event(), None, None
        if self.peer:
            self.lock = os.open(os.path.join(self.dir, f"lock-{role}"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.lockf(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(self.lock)
                raise StoreError(f"another {role} role is running on the store {self.dir}") from None
            self.beater = threading.Thread(target=self.beat, daemon=True)
            self.beater.start()

    def check(self, key):
        if not isinstance(key, str) or not self.KEY.fullmatch(key) or ".." in key:
            raise ValueError(f"bad store key {key!r}")
        return key

    def path(self, key):
        return os.path.join(self.dir, self.check(key) + ".json")

    def enter_phase(self, idx):
        """This role starts schedule position `idx`: published in the heartbeat, and the phase before
        it timed (the auto progress timeout follows the slowest)."""
        now = time.monotonic()
        if self.phase >= 0:
            self.slowest = max(self.slowest, now - self.phase_start)
        self.phase, self.phase_start = idx, now

    def put(self, key, obj):
        if self.beat_error:
            raise StoreError(self.beat_error)
        t0 = time.perf_counter()
        try:
            self.write(key, obj)
        except FileNotFoundError:  # the temporary file went (a prune that judged it stale): write it again
            self.write(key, obj)
        self.io_time += time.perf_counter() - t0

    def write(self, key, obj):
        """Atomically: a temporary file (named for this process, never ending in .json, so never read
        as a record), locked while it is written, fsynced, renamed; removed if anything fails."""
        path = self.path(key)
        tmp = f"{path}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # prune leaves a locked temporary file alone
            data = json.dumps(obj).encode()
            while data:  # through this one descriptor, so that the lock holds until the rename
                data = data[os.write(fd, data):]
            os.fsync(fd)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.remove(tmp)
            except OSError:
                pass
            raise
        finally:
            os.close(fd)

    def read(self, key):
        """The record, a JSON object, or None if it is not there (yet)."""
        t0 = time.perf_counter()
        try:
            with os.fdopen(os.open(self.path(key), os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
                data = f.read(self.MAX_BYTES + 1)
            rec = json.loads(data) if len(data) <= self.MAX_BYTES else None
        except FileNotFoundError:
            return None
        except (OSError, ValueError, RecursionError) as e:  # a directory, a symlink, not JSON, nested too deep
            raise StoreError(f"store {self.dir}: record {key} cannot be read ({type(e).__name__}: {e})") from None
        finally:
            self.io_time += time.perf_counter() - t0
        if not isinstance(rec, dict):
            raise StoreError(f"store {self.dir}: record {key} is not a JSON object of at most {self.MAX_BYTES} bytes")
        return rec

    def progress_limit(self, starting=False):
        """Seconds a wait for one record of a live peer may take (0: no limit); `starting`: of a peer
        that has not entered its schedule yet."""
        if self.progress_timeout >= 0:
            return self.progress_timeout
        return self.START_LIMIT if starting else max(self.AUTO_FLOOR, self.AUTO_FACTOR * self.slowest)

    def wait(self, *keys):
        """(key, record) of the first of `keys` present; polls, watching the peer's heartbeat."""
        delay, t_start = 0.0005, time.monotonic()
        last_check = t_start
        while True:
            for key in keys:
                if (rec := self.read(key)) is not None:
                    return key, rec
            if time.monotonic() - last_check > 1.0:
                heartbeat, last_check = self.check_peer(), time.monotonic()
                self.check_progress(keys, heartbeat, last_check - max(t_start, self.peer_phase[1]))
            time.sleep(delay)
            delay = min(2 * delay, 0.02)

    def check_progress(self, keys, heartbeat, waited):
        """StoreError if the live peer has been in one phase of the schedule, or still starting (phase -1:
        loading, its cold start), for all of `waited` (counted from the later of the wait's start and the
        peer's entering that phase) and that is past the progress limit."""
        phase = heartbeat.get("phase")
        if type(phase) is not int:
            return
        limit = self.progress_limit(starting=phase < 0)
        if not limit or waited <= limit:
            return
        knob = "START_LIMIT" if phase < 0 else "AUTO_FLOOR"
        how = ("progress_timeout" if self.progress_timeout >= 0 else "START_LIMIT" if phase < 0 else
               f"{self.AUTO_FACTOR:g} x this role's slowest phase so far, at least AUTO_FLOOR")
        where = (f"has not started its schedule (it was {str(heartbeat.get('doing'))[:200]})" if phase < 0
                 else f"stays in phase {phase} of the schedule")
        raise StoreError(f"waited {waited:.0f} s for record {' or '.join(keys)} in {self.dir}; the {self.peer} role "
                         f"is alive but {where} (the limit was {limit:.0f} s: {how}"
                         + (")" if self.progress_timeout >= 0 else f" = {limit:g} s, in store.py)")
                         + ". If it can take longer, raise "
                         + ("progress_timeout" if self.progress_timeout >= 0 else f"FileStore.{knob} in store.py")
                         + " and restart both roles with --resume")

    def check_peer(self):
        """The peer's heartbeat ({} if unreadable); StoreError if its counter has not moved for `timeout`
        seconds of this process's clock, or if this role's own heartbeat failed."""
        if self.beat_error:
            raise StoreError(self.beat_error)
        try:
            heartbeat = self.read(f"heartbeat-{self.peer}") or {}
        except StoreError:
            heartbeat = {}  # malformed: it counts as a heartbeat that did not move
        count, now = heartbeat.get("count") if type(heartbeat.get("count")) is int else None, time.monotonic()
        if heartbeat.get("phase") != self.peer_phase[0]:
            self.peer_phase = (heartbeat.get("phase"), now)
        if count != self.seen[0]:
            self.seen = (count, now)
        elif now - self.seen[1] > self.timeout:
            raise StoreError(f"the {self.peer} role {'has sent no heartbeat' if count is None else 'has been silent'} "
                             f"for {now - self.seen[1]:.0f}s (store {self.dir}); start it (python mgrpo.py --role "
                             f"{self.peer} --store ...), or restart it with --resume")
        return heartbeat

    def wait_peer(self):
        """Block until the peer's heartbeat counter moves: it runs now, it is no earlier run's record."""
        first = self.check_peer().get("count", -1)
        while self.check_peer().get("count", -1) == first:
            time.sleep(0.1)

    def beat(self):
        count, failing = 0, None
        while True:
            count += 1
            try:
                self.write(f"heartbeat-{self.role}", {"count": count, "pid": os.getpid(), "phase": self.phase,
                                                      "saved": self.saved, "doing": self.doing})
                failing = None
            except OSError as e:
                if failing is None:
                    failing = time.monotonic()
                    print(f"warning: heartbeat write to {self.dir} failed ({e}); retrying", flush=True)
                elif time.monotonic() - failing > self.timeout / 2:  # before the peer gives up on this role
                    self.beat_error = f"heartbeat writes to {self.dir} kept failing for {self.timeout / 2:.0f}s: {e}"
                    return
            if self.stop.wait(1.0):
                return

    def close(self):
        """Stop the heartbeat and release the role's lock (another process of this role may then open
        the store). Closing twice is harmless."""
        self.stop.set()
        if self.beater is not None:
            self.beater.join(timeout=self.timeout)  # a write stuck on a hung file system is left behind
            self.beater = None
        if self.lock is not None:
            os.close(self.lock)
            self.lock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def prune(self, before):
        """Delete the records of phases before schedule position `before`, and stale temporary files:
        any that no writer holds locked, whatever its time stamp, but this process's own."""
        for name in os.listdir(self.dir):
            path, m = os.path.join(self.dir, name), re.fullmatch(r"p(\d+)-.*\.json", name)
            try:
                if m and int(m.group(1)) < before:
                    os.remove(path)
                elif name.endswith(".tmp") and f".{os.getpid()}." not in name:
                    self.remove_stale(path)
            except OSError:  # the other role's rename got there first, or a planted directory
                pass

    @staticmethod
    def remove_stale(path):
        """Remove a temporary file unless its writer holds it locked (it is writing it now), and only if
        the path still names the file that was locked (not a record it became)."""
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: a live writer has it
            if os.fstat(fd).st_ino == os.lstat(path).st_ino:
                os.remove(path)
        finally:
            os.close(fd)
