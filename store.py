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

    Writes are atomic (a temporary file created exclusively, never through a symlink, fsynced, renamed);
    keys are checked, so no record lands outside the directory; a record that is no JSON object, or a
    symlink, is an error that names it; a lock keeps a second process of a role off the store. Each role
    writes a heartbeat with a counter every second, which the reader times on its own clock (the
    machines' clocks need not agree): a peer whose counter stood still for `timeout` s is gone; with
    `progress_timeout`, a wait for one record of a live peer ends after that long. Both raise StoreError.
    """
    KEY, MAX_BYTES = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}"), 64 * 2 ** 20

    def __init__(self, root, run_id, role, timeout=60.0, progress_timeout=0.0):
        self.dir, self.role = os.path.join(root, self.check(run_id)), role
        self.peer = {"main": "sub", "sub": "main"}.get(role)
        os.makedirs(self.dir, exist_ok=True)
        self.timeout, self.progress_timeout = timeout, progress_timeout
        self.io_time = 0.0           # seconds spent reading and writing records, not waiting
        self.phase = self.saved = 0  # published in the heartbeat: the schedule position worked on, saved
        self.beat_error = None       # set by the heartbeat thread when its writes keep failing
        self.seen = (None, time.monotonic())  # the peer's heartbeat counter, and when it last moved
        self.stop = threading.Event()
        if self.peer:
            self.lock = os.open(os.path.join(self.dir, f"lock-{role}"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.lockf(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                raise StoreError(f"another {role} role is running on the store {self.dir}") from None
            threading.Thread(target=self.beat, daemon=True).start()

    def check(self, key):
        if not isinstance(key, str) or not self.KEY.fullmatch(key) or ".." in key:
            raise ValueError(f"bad store key {key!r}")
        return key

    def path(self, key):
        return os.path.join(self.dir, self.check(key) + ".json")

    def put(self, key, obj):
        if self.beat_error:
            raise StoreError(self.beat_error)
        t0 = time.perf_counter()
        self.write(key, obj)
        self.io_time += time.perf_counter() - t0

    def write(self, key, obj):
        path = self.path(key)
        tmp = f"{path}.{os.getpid()}.{secrets.token_hex(6)}.tmp"  # never ends in .json: never read
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "w") as f:
            json.dump(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

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
                if self.progress_timeout and last_check - t_start > self.progress_timeout:
                    raise StoreError(f"waited {last_check - t_start:.0f}s for {' or '.join(keys)} in {self.dir}; the "
                                     f"{self.peer} role is alive but stays in phase {heartbeat.get('phase')} "
                                     f"(--progress-timeout)")
            time.sleep(delay)
            delay = min(2 * delay, 0.02)

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
                                                      "saved": self.saved})
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
        self.stop.set()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def prune(self, before):
        """Delete the records of phases before schedule position `before`, and stale temporary files."""
        for name in os.listdir(self.dir):
            path, m = os.path.join(self.dir, name), re.fullmatch(r"p(\d+)-.*\.json", name)
            try:
                if (m and int(m.group(1)) < before) or (
                        name.endswith(".tmp") and time.time() - os.lstat(path).st_mtime > self.timeout):
                    os.remove(path)
            except OSError:  # the other role's rename got there first, or a planted directory
                pass
