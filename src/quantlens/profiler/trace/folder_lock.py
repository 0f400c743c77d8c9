"""One run per output folder at a time: a lock file holding the owner's pid.

Two runs writing traces into one ``out_dir`` would clear each other's files and leave a folder mixed from both.
:class:`FolderLock` takes ``out_dir/.quantlens.lock`` (created exclusively, the owner's pid inside); a second run
is refused with the owner's pid and the fix. A lock whose owner is gone (a killed run) is taken over, by one run
only when several start together. Within one process the lock belongs to the thread that took it: a run inside a
run (the same thread) enters again, another thread of the process is refused like another process.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from quantlens._io import write_error
from quantlens.errors import QuantLensError

__all__ = ["FolderLock", "LOCK_FILE"]

LOCK_FILE = ".quantlens.lock"
#: how many times (10 ms apart) an empty lock file is read again before it is taken for a killed run's
_EMPTY_TRIES = 200


#: folder -> [the thread holding its lock in this process, how many times it entered]
_THREADS: dict[Path, list] = {}
_THREADS_GUARD = threading.Lock()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


class FolderLock:
    """``with FolderLock(folder): ...``: the folder is this process's until the block ends (re-entrant within
    one process)."""

    def __init__(self, folder: str | os.PathLike, wait: float = 0.0):
        """``wait``: seconds to wait for another live process's lock before refusing (for writes that hold the
        folder a moment, such as the bad case that every rank of a sharded sensitivity saves)."""
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self._held = False
        self._wait = wait

    def __enter__(self) -> FolderLock:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a read-only disk, a file in the way: in words (write_error), before any work
            raise (write_error(exc, self.path) or exc) from None
        deadline = time.monotonic() + self._wait
        self._key = self.folder.resolve()
        while not self._enter_thread():
            if time.monotonic() >= deadline:
                raise QuantLensError(
                    f"{self.folder} is in use by another thread of this process ({self.path}); two runs into one "
                    "out_dir would clear each other's files. Run them one after the other, or give each its own "
                    "out_dir.")
            time.sleep(0.02)
        try:
            return self._enter_process(deadline)
        except OSError as exc:  # the lock file could not be made or written (a full disk, a read-only folder)
            self._leave_thread()
            worded = write_error(exc, self.path)
            if worded is None:
                raise
            raise worded from None
        except BaseException:
            self._leave_thread()
            raise

    def _enter_thread(self) -> bool:
        """Take the folder for this thread (again, for a run inside a run); False: another thread holds it."""
        me = threading.get_ident()
        with _THREADS_GUARD:
            entry = _THREADS.get(self._key)
            if entry is None:
                _THREADS[self._key] = [me, 1]
                return True
            if entry[0] == me:
                entry[1] += 1
                return True
            return False

    def _leave_thread(self) -> bool:
        """Leave this thread's hold; True when it was the outermost."""
        with _THREADS_GUARD:
            entry = _THREADS[self._key]
            entry[1] -= 1
            if entry[1] == 0:
                del _THREADS[self._key]
                return True
            return False

    def _enter_process(self, deadline: float) -> FolderLock:
        tries = 0
        while tries < 2:  # the second try after clearing a stale lock
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._owner(wait=True)
                if owner == os.getpid():
                    return self  # this process already holds it (a run inside a run)
                if owner is not None and _alive(owner) and time.monotonic() < deadline:
                    time.sleep(0.02)
                    continue
                if owner is not None and _alive(owner):
                    raise QuantLensError(
                        f"{self.folder} is in use by another quantlens run (pid {owner}, {self.path}); two runs into "
                        "one out_dir would mix their traces. Wait for it to finish, or give this QuantAnalysis "
                        "another out_dir.") from None
                self._clear_stale(owner)  # its owner is gone: a stale lock
                tries += 1
                continue
            try:
                with os.fdopen(fd, "w") as handle:
                    handle.write(str(os.getpid()))
            except OSError:
                self.path.unlink(missing_ok=True)  # (an empty lock file would hold the folder for 2 s)
                raise
            self._held = True
            return self
        raise QuantLensError(f"{self.path} could not be taken (it keeps reappearing); is another run starting?")

    def _clear_stale(self, owner: int | None) -> None:
        """Remove the lock file judged stale (owner ``owner``, dead, or no pid), and only that one: it is moved aside
        first (a rename moves a given file once, so of two runs clearing it together one does), and a file that
        turns out to hold another pid (a fresh lock made since it was judged) is put back."""
        moved = self.folder / f"{LOCK_FILE}.{os.getpid()}.{time.monotonic_ns()}.stale"
        try:
            os.rename(self.path, moved)
        except FileNotFoundError:
            return  # another run cleared it first
        try:
            text = moved.read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError):
            text = ""
        if text.isdigit() and int(text) != owner and _alive(int(text)):
            try:
                os.link(moved, self.path)  # a live run's fresh lock: give it back (unless a newer one is there)
            except FileExistsError:
                pass
        moved.unlink(missing_ok=True)

    def _owner(self, wait: bool = False) -> int | None:
        """The pid in the lock file (None: no lock, or no pid). ``wait``: a lock file still empty is given a
        moment, as its owner creates it and then writes its pid; taken for stale at once, it was removed under a
        run that had just started, and two runs wrote into one folder."""
        for attempt in range(_EMPTY_TRIES if wait else 1):
            if attempt:
                time.sleep(0.01)
            try:
                text = self.path.read_text(encoding="ascii").strip()
            except FileNotFoundError:
                return None
            except (OSError, UnicodeDecodeError):
                text = ""
            if text:
                return int(text) if text.isdigit() else None
        return None

    def __exit__(self, *exc) -> None:
        if self._held and self._owner() == os.getpid():
            self.path.unlink(missing_ok=True)
        self._held = False
        self._leave_thread()
