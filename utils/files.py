"""Files: content hashes, atomic writes, and the one policy for the directories k3c writes.

Output directories (``check_output``, ``atomic_dir``):
- every directory k3c writes holds a marker file (``MARKER``); a directory without it that is not
  empty was not written by k3c and is never deleted or replaced;
- replacing a directory k3c wrote is allowed only when the caller says so (``--force`` on the CLI);
- an output may not be an input, lie inside one or hold one, and may not be the current directory;
- a directory is written beside its target under a temporary name tagged with the writer's pid and
  renamed into place; what a killed writer left (its temporary directory, or the old directory it
  had moved aside and not yet deleted, or put back when the kill came between the two renames) is
  tidied up by the next writer of that target.

File digests (``sha256_file``): read whole once, then taken from a record under the cache while the
file's size, mtime and ctime are unchanged (docs/bundle.md §4).

Cache entries (``seal_entry``, ``verified_entry``): a directory whose files' sha256 are listed in
``CONTENTS`` (sha256sum's format); a read checks them against their sha256 (``sha256_file``) and
discards an entry that differs. Who
builds an entry holds its lock (``cache_lock``), so two k3c processes that need one entry build
it once: the second waits, then reads what the first wrote.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from ..errors import K3Error

MARKER = ".written-by-k3c"
MARKER_TEXT = "This directory was written by k3c; k3c replaces it only when told to (--force).\n"
CONTENTS = "contents.sha256"
DIGESTS = "digests"     # sha256_file's records, under the cache
RACY_NS = 2_000_000_000
_SHA256 = re.compile(r"[0-9a-f]{64}")
_TAG = "k3c-"  # temporary names: .<target name>.k3c-<pid>-<random> and .<target name>.k3c-<pid>-old
_NO_SPACE = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
             errno.EROFS: "read-only file system"}


def cache_dir() -> Path:
    """Where k3c keeps what it can rebuild: compiled modules, exports, native objects (``K3C_CACHE``)."""
    return Path(os.environ.get("K3C_CACHE", Path.home() / ".cache" / "k3c"))


def sha256_file(path: Path, block: int = 1 << 22) -> str:
    """The sha256 of the file at ``path``, read from a digest record (``DIGESTS`` in the cache, one
    per device and inode) while the file's size, mtime and ctime are the ones recorded with it, so
    reopening a bundle of many GB does not read it whole again (docs/bundle.md §4). Any write to the
    file moves its mtime and ctime, and ctime cannot be set back, so a changed file is read again. A
    file is recorded only once its timestamps are ``RACY_NS`` old: a write in the same timestamp
    tick as the hash would leave them as they were."""
    before = os.stat(path)
    stamp = [before.st_size, before.st_mtime_ns, before.st_ctime_ns]
    record = cache_dir() / DIGESTS / f"{before.st_dev}-{before.st_ino}"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        saved = json.loads(record.read_text())
        if saved["stat"] == stamp and _SHA256.fullmatch(saved["sha256"]):
            return saved["sha256"]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    after = os.stat(path)
    settled = time.time_ns() - max(after.st_mtime_ns, after.st_ctime_ns) > RACY_NS
    if settled and [after.st_size, after.st_mtime_ns, after.st_ctime_ns] == stamp:
        with contextlib.suppress(OSError, K3Error):  # a cache that cannot be written only costs time
            write_atomic(record, json.dumps({"stat": stamp, "sha256": h.hexdigest()}).encode())
    return h.hexdigest()


def digest_of(digests: dict[str, str]) -> str:
    """sha256 over sorted (relative name, file sha256) pairs: ``hash_dir`` from known file digests."""
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(f"{name}\0{digests[name]}\n".encode())
    return h.hexdigest()


def files_under(path: Path) -> dict[str, Path]:
    """Relative posix name -> path of every file in a directory tree."""
    return {f.relative_to(path).as_posix(): f for f in sorted(path.rglob("*")) if f.is_file()}


def hash_dir(path: Path) -> str:
    """sha256 over the sorted (relative name, file sha256) pairs of a directory tree."""
    return digest_of({name: sha256_file(f) for name, f in files_under(path).items()})


def inside(path: Path, root: Path) -> bool:
    """Whether ``path`` (symlinks resolved) is ``root`` or lies under it."""
    return Path(path).resolve().is_relative_to(Path(root).resolve())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, someone else's
    return True


def _leftovers(target: Path) -> list[tuple[Path, bool]]:
    """(path, is an old directory moved aside) of what writers of ``target`` that are no longer
    running left beside it."""
    out = []
    for p in target.parent.glob(f".{glob.escape(target.name)}.{_TAG}*"):
        pid, _, rest = p.name[len(target.name) + 2 + len(_TAG):].partition("-")
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            out.append((p, rest == "old"))
    return out


def recover(target: Path) -> None:
    """Tidy up after writers of ``target`` that were killed: put back the directory a writer had
    moved aside when ``target`` is missing (a kill between the two renames), delete the rest."""
    target = Path(target)
    if not target.parent.is_dir():
        return
    for path, old in _leftovers(target):
        if old and not os.path.lexists(target):
            os.rename(path, target)
        elif path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def written_by_k3c(path: Path) -> bool:
    return (Path(path) / MARKER).is_file()


def check_output(target: Path, *, force: bool, inputs=()) -> Path:
    """The output-directory policy (module docstring) for writing ``target``; K3Error when it is
    refused. Call it before any work, so a refused output costs nothing. Returns ``target``."""
    target = Path(target)
    resolved = target.resolve()
    if Path.cwd().resolve().is_relative_to(resolved):
        raise K3Error(f"output directory {target} is the current directory or holds it; name a new directory")
    for given in inputs:
        if given is None:
            continue
        source = Path(given).resolve()
        if resolved.is_relative_to(source) or source.is_relative_to(resolved):
            raise K3Error(f"output directory {target} and input {given} are the same or one holds the other; "
                          f"write the output elsewhere")
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise K3Error(f"output {target} exists and is a symbolic link or not a directory; k3c does not replace it")
    _probe_writable(target)
    recover(target)
    if target.is_dir() and any(target.iterdir()):
        if not written_by_k3c(target):
            raise K3Error(f"output directory {target} exists and was not written by k3c; k3c never replaces "
                          f"it: name a new directory")
        if not force:
            raise K3Error(f"output directory {target} exists (written by k3c); give --force to replace it")
    return target


def _probe_writable(target: Path) -> None:
    """Create and remove a directory where ``target``'s temporary directory will go, so that a
    read-only or forbidden place fails before any work (K3Error)."""
    place = target.resolve().parent
    while not place.exists():
        place = place.parent
    with _writing(target):
        os.rmdir(tempfile.mkdtemp(prefix=f".{target.name}.{_TAG}{os.getpid()}-", dir=place))


@contextlib.contextmanager
def _writing(target: Path, permission: bool = True):
    """Turn a full or read-only file system (and, with ``permission``, a directory k3c may not write
    in) into a K3Error naming ``target``."""
    try:
        yield
    except OSError as e:
        if e.errno in _NO_SPACE:
            raise K3Error(f"cannot write {target}: {_NO_SPACE[e.errno]}") from None
        if permission and isinstance(e, PermissionError):
            raise K3Error(f"cannot write {target}: permission denied ({e.filename})") from None
        raise


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, then rename it into place."""
    path = Path(path)
    with _writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        recover(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{_TAG}{os.getpid()}-", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            os.remove(tmp)
            raise


@contextlib.contextmanager
def atomic_dir(target: Path, *, force: bool = True):
    """Yield a temporary directory beside ``target``; rename it to ``target`` on success (with the
    k3c marker), remove it on any failure (including KeyboardInterrupt and, through the CLI's
    handler, SIGTERM). An existing ``target`` is replaced only as ``check_output`` allows."""
    target = Path(target)
    with _writing(target):
        check_output(target, force=force)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.{_TAG}{os.getpid()}-", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the result should look like any new directory
    old = target.with_name(f".{target.name}.{_TAG}{os.getpid()}-old")
    try:
        with _writing(target, permission=False):  # the caller's own errors stay as they are
            yield tmp
            (tmp / MARKER).write_text(MARKER_TEXT)
            check_output(target, force=force)  # another writer may have come first
            if target.exists():
                os.rename(target, old)
                os.rename(tmp, target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, target)
    except BaseException:
        if old.exists() and not os.path.lexists(target):
            os.rename(old, target)  # interrupted between the two renames: put the old one back
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def seal_entry(root: Path) -> None:
    """Write ``CONTENTS``: the sha256 of every other file under ``root``, in sha256sum's format."""
    lines = [f"{sha256_file(f)}  {name}\n" for name, f in files_under(root).items() if name not in (CONTENTS, MARKER)]
    (root / CONTENTS).write_text("".join(lines))


@contextlib.contextmanager
def cache_lock(entry: Path, log=None):
    """Hold the lock of cache entry ``entry`` (an advisory ``flock`` on ``.<name>.lock`` beside it)
    while the block looks the entry up and builds it, saying so with ``log`` when another process
    holds it; the lock goes with the process, however it ends."""
    entry = Path(entry)
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(entry.with_name(f".{entry.name}.lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if log:
                log(f"waiting for another k3c process that is building {entry}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def verified_entry(entry: Path, names: tuple[str, ...], log=print) -> Path | None:
    """``entry`` when it holds ``names`` and every file matches its sha256 in ``CONTENTS``; else
    None, after deleting a damaged entry (and saying so in one line) so that it is rebuilt."""
    if not os.path.lexists(entry):
        return None
    try:
        listed = {name: digest for digest, _, name in
                  (line.partition("  ") for line in (entry / CONTENTS).read_text().splitlines())}
        actual = {name: sha256_file(f) for name, f in files_under(entry).items() if name not in (CONTENTS, MARKER)}
    except (OSError, UnicodeDecodeError):
        listed, actual = None, {}
    if listed is None:
        problem = f"{CONTENTS} is missing or unreadable"
    elif not set(names) <= actual.keys():
        problem = f"{sorted(set(names) - actual.keys())[0]} is missing"
    elif actual != listed:
        problem = f"{next(n for n in sorted(actual.keys() | listed.keys()) if actual.get(n) != listed.get(n))} " \
                  f"does not match its sha256"
    else:
        return entry
    log(f"cache entry {entry} is damaged ({problem}); discarding it and rebuilding")
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        entry.unlink(missing_ok=True)
    return None
