"""A checkpoint file on disk: written atomically, read back with its header checked."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from pyro_bdl.checkpoint._parts import CheckpointError

__all__ = ["FORMAT", "VERSION", "atomic_save", "read"]

FORMAT = "pyro_bdl.checkpoint"
VERSION = 1
_KEYS = ("fingerprint", "param_store", "guide", "modules", "optim", "generators", "step", "rng")


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
    # Same folder as the target, so os.replace is a rename within one file system (atomic).
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a checkpoint is an ordinary file
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
    try:
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
            f"with keys {sorted(payload)}; this version reads version {VERSION}."
        )
    return payload
