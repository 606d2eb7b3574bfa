"""Files that must never be lost or half-written: checkpoints (with a checksum) and results.

Every write goes to a temporary file in the same directory, is flushed to disk, and is renamed
over the old file (atomic on POSIX): a kill or a full disk leaves the previous file intact and no
temporary behind.  A checkpoint is ``MAGIC + sha256(payload) + "\\n" + payload`` with ``payload``
the ``torch.save`` bytes, so a truncated, emptied or corrupted checkpoint is refused when read
instead of loading wrong optimizer or accountant state.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import pickle
import re
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Union

import torch

__all__ = ["CheckpointError", "KINDS", "checkpoint_kind", "save_checkpoint", "load_checkpoint", "write_atomically",
           "check_fits",
           "checkpoint_destination",
           "keyed_fingerprint", "read_fingerprint_key", "fingerprint_key_for", "fingerprint_key_path",
           "check_records", "keep_earlier_files", "check_checkpoint_free", "claim_directory", "release_directories"]

MAGIC = b"clipless checkpoint v1\n"
_DIGEST_LEN = 64  # hex sha256


class CheckpointError(ValueError):
    """A checkpoint or result file that cannot be written or read back intact."""


def write_atomically(path: Union[str, Path], data: bytes, mode: Optional[int] = None) -> None:
    """Replace ``path`` by ``data`` all at once, or leave it as it was (and no temporary file); ``mode``: the
    new file's permissions, set before it replaces the old one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as fh:
            if mode is not None:
                os.chmod(tmp, mode)
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise CheckpointError(f"could not write {path}: {err.strerror or err}; the previous file (if any) is "
                                  "intact") from err
        raise


_CLAIMED: Dict[Path, int] = {}  # directories this process writes its run's files to -> the descriptor holding its lock


def claim_directory(directory: Union[str, Path]) -> None:
    """Hold an exclusive ``flock`` on ``directory`` itself until :func:`release_directories` or the process's end
    (no file is added to it): a second run writing the same directory at the same time would move this one's files
    aside and replace its checkpoint and result with its own.  A directory another process holds is refused
    (:class:`CheckpointError`); a second claim in this process is a no-op.  Where ``flock`` does not exist
    (Windows) or fails (a file system without it), nothing is locked, with a warning there."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - POSIX only
        return
    key = Path(directory).resolve()
    if key in _CLAIMED:
        return
    try:
        fd = os.open(key, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as err:  # an unreadable directory: the run goes on, unguarded, as where flock does not exist
        warnings.warn(f"could not open {directory} to lock it ({err.strerror or err}): a second run started there "
                      "meanwhile would not be refused", stacklevel=2)
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        # held: EWOULDBLOCK or EAGAIN, EACCES on systems where Python emulates flock with fcntl locks
        if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):  # no flock on this file system: unguarded
            warnings.warn(f"could not lock {directory} ({err.strerror or err}): a second run started there meanwhile "
                          "would not be refused", stacklevel=2)
            return
        raise CheckpointError(f"{directory} is being written by another run (another process holds its lock): two "
                              "runs in one directory would replace each other's checkpoint and result; wait for it "
                              "to end or choose another output directory") from None
    _CLAIMED[key] = fd


def release_directories() -> None:
    """Release every directory this process claimed (closing a descriptor drops its ``flock``)."""
    while _CLAIMED:
        os.close(_CLAIMED.popitem()[1])


def check_checkpoint_free(path: Optional[Path], continued: Optional[Path]) -> None:
    """Refuse to train with checkpoints written to ``path`` when a file is there that this run neither resumed from
    nor wrote (``continued``: the resolved path it did): an earlier run's checkpoint, replaced at the first epoch's
    end."""
    if path is None or not path.exists() or (continued is not None and path.resolve() == continued):
        return
    raise CheckpointError(f"checkpoint_path {path} holds a file already (an earlier run's checkpoint?), which this "
                          f"run would replace at the end of its first epoch: load_checkpoint('{path}') continues "
                          "that run; give another checkpoint_path, or move the file, to start a new one")


def keep_earlier_files(directory: Union[str, Path], names: Sequence[str]) -> Optional[Path]:
    """Move the files of ``names`` that ``directory`` already holds (an earlier run's result, checkpoint and key,
    figures) into a new ``directory/earlier-<their newest modification time>/``, so that a new run written there
    replaces none of them; returns that folder, or ``None`` when there was nothing to keep.  Each file is moved by
    one rename: a kill between two leaves every file whole, in one place or the other."""
    directory = Path(directory)
    found = [directory / name for name in names if (directory / name).is_file()]
    if not found:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(max(f.stat().st_mtime for f in found)))
    keep, n = directory / f"earlier-{stamp}", 1
    while keep.exists():
        n += 1
        keep = directory / f"earlier-{stamp}-{n}"
    try:
        keep.mkdir()
        for f in found:
            os.replace(f, keep / f.name)
    except OSError as err:
        raise CheckpointError(f"could not move the earlier run's files in {directory} to {keep} "
                              f"({err.strerror or err}); nothing was replaced: choose another output directory"
                              ) from err
    return keep


def checkpoint_destination(path: Optional[Union[str, Path]]) -> Optional[Path]:
    """The file a run will write its checkpoints to (None: no checkpoints), checked before it trains: an existing
    directory, or a path under an existing file, would fail only at the end of the first epoch, after its work."""
    if not path:
        return None
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"checkpoint_path {path} is a directory: give a file in it, e.g. "
                              f"{path / 'checkpoint.pt'}")
    above = next((parent for parent in path.parents if parent.exists()), None)
    if above is not None and not above.is_dir():
        raise CheckpointError(f"checkpoint_path {path} lies under {above}, which is a file, not a directory")
    return path


def save_checkpoint(state: Dict[str, Any], path: Union[str, Path]) -> None:
    """Write ``state`` with its checksum, atomically."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    write_atomically(path, MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)


# Each kind of checkpoint: what it is, what writes and resumes it, and the entry that holds its weights (which
# tells apart the checkpoints of earlier versions, which do not record their kind).
KINDS = {
    "training": ("a private training checkpoint", "PrivateTrainer, clipless train --resume", "model"),
    "pretraining": ("a contrastive pre-training checkpoint", "ContrastivePretrainer, clipless pretrain --resume",
                    "encoder"),
}


def checkpoint_kind(state: Dict[str, Any]) -> Optional[str]:
    """``state['kind']``, or for a checkpoint that does not record it, the kind whose weights it holds."""
    if state.get("kind") in KINDS:
        return state["kind"]
    return next((kind for kind, (*_, weights) in KINDS.items() if weights in state), None)


def load_checkpoint(path: Union[str, Path], map_location: Any = "cpu", kind: Optional[str] = None) -> Dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint`; refuses a damaged one, and one of another ``kind``
    than asked (a :data:`KINDS` key), with a clear message."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise CheckpointError(f"cannot read checkpoint {path}: {err.strerror or err}") from err
    head = len(MAGIC) + _DIGEST_LEN + 1
    if not raw.startswith(MAGIC) or len(raw) < head:
        raise CheckpointError(f"{path} is not a clipless checkpoint (empty, truncated, written by another program or "
                              "by an older version): resume from an intact checkpoint or restart training")
    digest, payload = raw[len(MAGIC) : head - 1], raw[head:]
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        raise CheckpointError(f"checkpoint {path} is damaged (its checksum does not match: truncated or corrupted); "
                              "resume from an intact copy or restart training")
    try:
        # A checkpoint holds tensors, numbers, strings and containers only; anything else would be unpickled by
        # running code the file names, which the checksum cannot vouch for (whoever wrote the file wrote it too).
        state = torch.load(io.BytesIO(payload), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        named = re.search(r"GLOBAL ([\w.]+)", str(err))
        raise CheckpointError(f"checkpoint {path} holds more than tensors, numbers, strings and containers"
                              + (f" (it names {named.group(1)})" if named else "") + ": loading it could run code "
                              "from whoever wrote the file, and clipless never writes such a checkpoint; refused"
                              ) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} does not hold a training state")
    found = checkpoint_kind(state)
    if kind is not None and found != kind:
        what = (f"{KINDS[found][0]} ({KINDS[found][1]})" if found is not None
                else "a checkpoint of neither trainer (it holds no model and no encoder)")
        raise CheckpointError(f"{path} is {what}, not {KINDS[kind][0]} ({KINDS[kind][1]}): resume or export it with "
                              "what wrote it (a pre-training run also writes its encoder's weights to encoder.pt)")
    return state


def check_fits(module: Any, saved: Dict[str, Any], path: Union[str, Path], what: str = "model") -> None:
    """Refuse a saved ``state_dict`` whose names or shapes differ from ``module``'s before any of it is loaded
    (``load_state_dict`` copies the matching entries before it reports the others)."""
    own = module.state_dict()
    missing, unexpected = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
    reshaped = sorted(k for k in set(own) & set(saved)
                      if getattr(saved[k], "shape", None) != getattr(own[k], "shape", None))
    if missing or unexpected or reshaped:
        detail = "; ".join(f"{label}: {', '.join(keys[:4])}" for label, keys in
                           (("missing", missing), ("unexpected", unexpected), ("other shape", reshaped)) if keys)
        raise CheckpointError(f"checkpoint {path} holds another {what} ({detail}): resume with the same architecture")


# A checkpoint records digests of the training and test records so that a resume on other data is refused.  A plain
# digest would identify the records to anyone holding the checkpoint (hash both neighbouring datasets and compare),
# so the checkpoint keeps a digest keyed by a secret 32-byte key, which lives in a file of its own beside it
# (``checkpoint.pt.key``, owner-only): the checkpoint alone says nothing about which records were trained on.
_KEY_BYTES = 32


def fingerprint_key_path(path: Union[str, Path]) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".key")


def keyed_fingerprint(fingerprint: Optional[str], key: bytes) -> Optional[str]:
    """BLAKE2b of a records digest, keyed by ``key`` (None stays None: a dataset without a digest)."""
    if fingerprint is None:
        return None
    return hashlib.blake2b(fingerprint.encode(), key=key, digest_size=16).hexdigest()


def fingerprint_key_for(path: Union[str, Path]) -> bytes:
    """The key for a checkpoint about to be written at ``path``: the one already beside it, else a new one from OS
    entropy, written first.  An existing key is never replaced, so a failed write leaves the previous checkpoint
    and its key matching (any key hides the records equally well)."""
    try:
        key = read_fingerprint_key(path)
    except CheckpointError:  # a damaged key file: the checkpoint beside it can no longer be checked anyway
        key = None
    if key is None:
        key = os.urandom(_KEY_BYTES)
        write_atomically(fingerprint_key_path(path), key, mode=0o600)
    return key


def read_fingerprint_key(path: Union[str, Path]) -> Optional[bytes]:
    """The key beside checkpoint ``path``; None when there is no key file (a checkpoint of an older version)."""
    key_path = fingerprint_key_path(path)
    try:
        key = key_path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise CheckpointError(f"cannot read {key_path}: {err.strerror or err}") from err
    if len(key) != _KEY_BYTES:
        raise CheckpointError(f"{key_path} is damaged ({len(key)} bytes, not {_KEY_BYTES}): it keys the checkpoint's "
                              "digest of the training records; resume with the key file written beside the checkpoint")
    return key


def check_records(path: Union[str, Path], name: str, saved: Optional[str], fingerprint: Optional[str],
                  key: Optional[bytes], hint: str) -> None:
    """Refuse a resume whose records are not those of checkpoint ``path`` (its ``name`` digest ``saved``, keyed by
    ``key`` from the key file beside it; None: a checkpoint of an older version, with a plain digest)."""
    current = fingerprint if key is None else keyed_fingerprint(fingerprint, key)
    if saved == current:
        return
    if key is None:
        raise ValueError(f"checkpoint {path}: its key file {fingerprint_key_path(path).name} is missing (it keys the "
                         "checkpoint's digest of the records, kept apart so that the checkpoint alone does not "
                         "identify them): copy it with the checkpoint")
    raise ValueError(f"checkpoint {path} has {name}={saved!r} but this run has {current!r}: resume with the same "
                     f"records {hint}")
