"""CPU executors on one host share its cores instead of fighting over them.

An executor on the CPU runs one thread per core by default, and its OpenMP threads spin a
while at every barrier (launcher.executor_openmp_defaults). Two such executors busy at
once on the same cores (two stacks on one host, scheduler replicas, a test run beside a
stack) each lose their threads to the other's in the middle of a parallel region: every
region then waits for a descheduled thread, and both run several times slower than one
executor with half the cores would (docs/overhead.md, "Two executors on one host").

So each CPU executor process registers in a per-user directory on the host and marks
itself busy while it runs steps; an executor whose thread count is automatic
(`--num-threads 0`, one rank) re-reads the register between steps, at most every CHECK_S,
and runs its threads divided by the executors busy on CPUs it may use. (The ranks of a
tensor-parallel group keep the split they start with, and are counted by the others.)

    /dev/shm/pagedserve-executors-<uid>/<pid>-<random>
        its text: the CPUs the process may run on
        its flock: held while the process lives (a dead one's file is removed)
        its mtime: the process's last step (busy: a step within BUSY_S)

An executor that goes idle gives its share back within BUSY_S + CHECK_S. Processes that
do not see the same directory (containers with their own /dev/shm, other users) are not
counted.
"""
from __future__ import annotations

import errno
import fcntl
import os
import tempfile
import time
import uuid

CHECK_S = 0.5          # how often a busy executor re-reads the register
BUSY_S = 2.0           # a peer that ran a step this recently counts as busy


def register_dir() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"pagedserve-executors-{os.getuid()}")


def _cpus() -> frozenset[int]:
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


class HostShare:
    """This process's entry in the host's register of CPU executors."""

    def __init__(self, threads: int, folder: str | None = None) -> None:
        self.base = max(1, threads)        # the thread count with the cores to itself
        self.folder = folder or register_dir()
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        self.cpus = _cpus()
        # (the pid alone could clash: processes of other PID namespaces may share the folder)
        name = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.path = os.path.join(self.folder, name)
        # Made under a hidden name and renamed once locked: a reader must never find the
        # entry unlocked, and take it for a dead process's.
        hidden = os.path.join(self.folder, "." + name)
        self._fd = os.open(hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(self._fd, ",".join(map(str, sorted(self.cpus))).encode())
        os.utime(self._fd, (0, 0))          # idle until its first step
        os.rename(hidden, self.path)
        self._checked = self._marked = float("-inf")
        self.threads = self.base
        self.peers = 0                      # busy executors beside this one, last read

    def close(self) -> None:
        if self._fd >= 0:
            try:
                os.unlink(self.path)
            except OSError:
                pass
            os.close(self._fd)
            self._fd = -1

    def mark_busy(self) -> None:
        """This process runs steps (its mtime, read by the others; at most every CHECK_S)."""
        now = time.monotonic()
        if now - self._marked >= CHECK_S:
            os.utime(self._fd)
            self._marked = now

    def busy_peers(self) -> int:
        """Other live executors that ran a step within BUSY_S on CPUs this one may use."""
        now, count = time.time(), 0
        try:
            names = os.listdir(self.folder)
        except OSError:
            return 0
        for name in names:
            path = os.path.join(self.folder, name)
            if path == self.path or name.startswith("."):
                continue
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except OSError as exc:
                    if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        continue
                    alive = True
                else:
                    alive = False      # nobody holds it: its process is gone
                if not alive:
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
                    continue
                st = os.fstat(fd)
                if now - st.st_mtime > BUSY_S:
                    continue
                cpus = os.pread(fd, 4096, 0).decode(errors="replace")
                theirs = {int(c) for c in cpus.split(",") if c.strip().isdigit()}
                if not theirs or theirs & self.cpus:
                    count += 1
            finally:
                os.close(fd)
        return count

    def share(self) -> int:
        """Before a step: mark this executor busy and return its thread count for the
        executors busy now (the register is read at most every CHECK_S)."""
        self.mark_busy()
        now = time.monotonic()
        if now - self._checked >= CHECK_S:
            self._checked = now
            self.peers = self.busy_peers()
            self.threads = max(1, self.base // (1 + self.peers))
        return self.threads
