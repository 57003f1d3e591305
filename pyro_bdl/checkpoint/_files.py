"""A checkpoint file on disk: written atomically, read back with its header checked.

A write goes to a temporary file next to the target, named ``.<target>.tmp-<pid>-<random>``, is
flushed to disk (``fsync``) and renamed over the target (``os.replace``, atomic within one file
system). A process killed mid-write cannot delete its own temporary file, so every save first
removes the temporary files of *its own target* whose writer is no longer alive: the pid in the
name says whose they are. Files of other targets and of live writers are never touched.

Every file also holds a ``"checksums"`` entry (:func:`checksums`): a BLAKE2 digest of each
tensor's bytes (with its dtype and shape), keyed by where the tensor sits, and one of the plain
values. :func:`read` recomputes them and refuses a file whose bytes changed after it was written
(a flipped bit on disk or in a copy), naming the entry. Files written before checksums existed
have none and load unchecked; the entry is optional, so older readers load newer files too.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from collections.abc import Iterator
from typing import Any

import torch

from pyro_bdl.checkpoint._parts import CheckpointError

__all__ = [
    "CHECKSUMS",
    "FORMAT",
    "VERSION",
    "atomic_save",
    "checksums",
    "read",
    "remove_stale",
    "temporary_name",
]

FORMAT = "pyro_bdl.checkpoint"
VERSION = 1
_KEYS = ("fingerprint", "param_store", "guide", "modules", "optim", "generators", "step", "rng")
#: The payload key of the checksums (optional: files written before them have none).
CHECKSUMS = "checksums"
#: The checksum entry of everything that is not a tensor.
_PLAIN = "<plain values>"


def _walk(value: Any, where: str, plain: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of ``value`` by where they sit (``param_store['values']['loc']``); every
    other leaf (and every key) is appended to ``plain`` as its repr, in order."""
    if isinstance(value, torch.Tensor):
        yield where, value
    elif isinstance(value, dict):
        for k, v in value.items():
            plain.append(repr(k))
            yield from _walk(v, f"{where}[{k!r}]", plain)
    elif isinstance(value, (list, tuple)):
        plain.append(f"{type(value).__name__}{len(value)}")
        for i, v in enumerate(value):
            yield from _walk(v, f"{where}[{i}]", plain)
    else:
        plain.append(repr(value))


def _digest(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    h = hashlib.blake2b(f"{t.dtype}{tuple(t.shape)}".encode(), digest_size=16)
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def checksums(payload: dict[str, Any]) -> dict[str, str]:
    """Where each tensor of ``payload`` sits -> the digest of its bytes, dtype and shape; and
    ``"<plain values>"`` -> the digest of every other value and key, in order (the checksums
    entry itself left out)."""
    plain: list[str] = []
    out = {
        where: _digest(t)
        for key, value in payload.items()
        if key != CHECKSUMS
        for where, t in _walk(value, key, plain)
    }
    parts = [repr(k) for k in payload if k != CHECKSUMS] + plain
    out[_PLAIN] = hashlib.blake2b("\x00".join(parts).encode(), digest_size=16).hexdigest()
    return out


def _verify(payload: dict[str, Any], path: str) -> None:
    saved = payload.get(CHECKSUMS)
    if saved is None:
        return  # written before checksums existed
    if not isinstance(saved, dict):
        what = f"its checksums entry is a {type(saved).__name__}, not a dict of digests"
    else:
        now = checksums(payload)
        bad = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        if not bad:
            return
        more = f" (and {len(bad) - 1} more entries)" if len(bad) > 1 else ""
        what = f"the data of {bad[0]}{more} does not match the checksum saved with it"
    raise CheckpointError(
        f"{path!r} is corrupt: {what}, so the file changed after it was written (disk, copy "
        "or transfer damage); nothing was changed. Resume from another copy or an earlier "
        "checkpoint."
    )


def temporary_name(path: str, pid: int | None = None) -> str:
    """The temporary file a process writes ``path`` through (same folder, hidden)."""
    folder, base = os.path.split(os.path.abspath(path))
    pid = os.getpid() if pid is None else pid
    return os.path.join(folder, f".{base}.tmp-{pid}-{secrets.token_hex(4)}")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True  # another thread of this process may be writing it
    if os.name == "nt":  # os.kill(pid, 0) would terminate the process there: keep the file
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, but another user's
        return True
    try:  # a killed child its parent has not reaped yet is a zombie: dead for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def remove_stale(path: str) -> list[str]:
    """Remove the temporary files of ``path`` left by writers that died mid-write; returns them.

    Only files named as :func:`temporary_name` names them for this very target, with the pid of
    a process that no longer runs (a pid reused by a live process keeps its file until then).
    """
    folder, base = os.path.split(os.path.abspath(path))
    pattern = re.compile(rf"\.{re.escape(base)}\.tmp-(\d+)-[0-9a-f]+")
    removed: list[str] = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        match = pattern.fullmatch(name)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        try:
            os.unlink(os.path.join(folder, name))
            removed.append(name)
        except FileNotFoundError:  # another saver removed it first
            pass
    return removed


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # Windows cannot open folders; the rename is still atomic there.
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_save(payload: dict[str, Any], path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    remove_stale(path)
    # Same folder as the target, so os.replace is a rename within one file system (atomic).
    tmp = temporary_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o644)
    except OSError as err:
        raise type(err)(
            err.errno, f"cannot write checkpoint {path!r}: {err.strerror} (folder {folder!r})"
        ) from err
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({**payload, CHECKSUMS: checksums(payload)}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(folder)


def read(path: str, map_location) -> dict[str, Any]:
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"no checkpoint at {path!r}: the file does not exist. Check the path (or start the "
            "run from step 0)."
        )
    if os.path.isdir(path):
        raise IsADirectoryError(
            f"cannot read checkpoint {path!r}: it is a folder, not a file. Pass the file that "
            "save_checkpoint wrote inside it."
        )
    try:
        # weights_only: tensors and plain values only; a pickled object is refused, never run.
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"cannot read checkpoint {path!r}: the file is truncated or corrupt, or holds more "
            f"than tensors and plain values ({type(err).__name__}: {reason}). Resume from an "
            "earlier checkpoint; save_checkpoint writes atomically, so files it wrote are whole."
        ) from err
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(
            f"{path!r} is not a pyro_bdl checkpoint (no {FORMAT!r} header). Write checkpoints "
            "with pyro_bdl.checkpoint.save_checkpoint."
        )
    if payload.get("version") != VERSION or any(k not in payload for k in _KEYS):
        raise CheckpointError(
            f"{path!r} is a pyro_bdl checkpoint of format version {payload.get('version')!r} "
            f"with keys {sorted(payload)}; this version reads version {VERSION}. Load it with the "
            "pyro_bdl version that wrote it, or restart the run."
        )
    _verify(payload, path)
    return payload
