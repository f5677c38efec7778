"""``<data_dir>/JOURNAL_MANIFEST``: what the journal's segment files alone cannot tell.

The segments say which records exist, not which *should*: deleting the last segment (or
cutting it at a record boundary) leaves a journal that looks complete. The manifest
records two facts so that recovery can notice:

``active_segment``
    the first LSN of the segment appends go to (the newest segment). Written when the
    journal opens a segment (start-up, roll), i.e. once per 64 MiB. That segment, or a
    newer one, must exist at the next start: the journal never deletes its active
    segment (``truncate_below`` keeps it, an empty leftover is removed only after the
    manifest names its replacement).
``clean_end_lsn``
    written by a clean close (``Journal.aclose``) once every record is fsynced: the
    journal ended exactly at this LSN. A journal that then ends earlier was damaged
    (a torn tail is impossible after a clean close), so it is refused instead of being
    cut. Cleared (the line left out) when the journal is opened again.

Format: ASCII lines ``rallypoint-journal-manifest 1``, ``active_segment N`` (optional),
``clean_end_lsn N`` (optional), ``crc N`` (CRC-32 of the lines before it). Written
atomically (temporary file, fsync, rename, fsync of the directory). Writing it is best
effort: a failure (say, a full disk) is logged and leaves the previous manifest, which
can only make the checks weaker (an older active segment, or no clean end), never make
an intact journal look damaged. An unreadable manifest is ignored with a warning.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from zlib import crc32

__all__ = ["Manifest", "MANIFEST_NAME", "read_manifest", "write_manifest", "remove_manifest"]

log = logging.getLogger("rallypoint.persistence")

MANIFEST_NAME = "JOURNAL_MANIFEST"  # in the data dir: journal/ holds segments only
_MAGIC = "rallypoint-journal-manifest 1"


@dataclass(frozen=True)
class Manifest:
    """Contents of ``JOURNAL_MANIFEST`` (see the module docstring).

    Attributes:
        active_segment: first LSN of the newest segment, or None (no segment).
        clean_end_lsn: last LSN of a cleanly closed journal, or None (running, or
            closed by a crash).
    """

    active_segment: int | None = None
    clean_end_lsn: int | None = None

    def encode(self) -> bytes:
        lines = [_MAGIC]
        if self.active_segment is not None:
            lines.append(f"active_segment {self.active_segment}")
        if self.clean_end_lsn is not None:
            lines.append(f"clean_end_lsn {self.clean_end_lsn}")
        body = "\n".join(lines) + "\n"
        return (body + f"crc {crc32(body.encode('ascii'))}\n").encode("ascii")


def _path(data_dir: str | os.PathLike[str]) -> Path:
    return Path(data_dir) / MANIFEST_NAME


def read_manifest(data_dir: str | os.PathLike[str]) -> Manifest | None:
    """The manifest of ``data_dir``'s journal, or None when there is none (a journal
    written before manifests existed, or a fresh data dir) or it is unreadable (logged
    as a warning; the checks it enables are then skipped)."""
    path = _path(data_dir)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("journal: cannot read %s (%s); checks of the journal's end are skipped", path, exc)
        return None
    try:
        text = raw.decode("ascii")
        body, _, tail = text.rpartition("crc ")
        if not body.startswith(_MAGIC + "\n") or int(tail.strip()) != crc32(body.encode("ascii")):
            raise ValueError("bad header or checksum")
        fields = {}
        for line in body.splitlines()[1:]:
            key, _, value = line.partition(" ")
            fields[key] = int(value)
        return Manifest(fields.get("active_segment"), fields.get("clean_end_lsn"))
    except (ValueError, UnicodeDecodeError) as exc:
        log.warning("journal: %s is damaged (%s); checks of the journal's end are skipped", path, exc)
        return None


def write_manifest(data_dir: str | os.PathLike[str], manifest: Manifest) -> None:
    """Replace the manifest atomically and durably (sync; a few fsyncs).

    Raises:
        OSError: the write failed; the previous manifest is intact. Callers in the
            journal log it and go on (see the module docstring).
    """
    path = _path(data_dir)
    tmp = path.with_name(MANIFEST_NAME + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        data = manifest.encode()
        if os.write(fd, data) != len(data):
            raise OSError(f"short write to {tmp}")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def try_write_manifest(data_dir: str | os.PathLike[str], manifest: Manifest) -> bool:
    """:func:`write_manifest`, logging a failure instead of raising; True when written."""
    try:
        write_manifest(data_dir, manifest)
        return True
    except OSError as exc:
        log.warning("journal: could not update %s (%s); the previous manifest stays (the checks "
                    "of the journal's end are weaker until the next update)", _path(data_dir), exc)
        try:
            os.unlink(_path(data_dir).with_name(MANIFEST_NAME + ".tmp"))
        except OSError:
            pass
        return False


def remove_manifest(data_dir: str | os.PathLike[str]) -> None:
    """Delete the manifest (idempotent)."""
    try:
        os.unlink(_path(data_dir))
    except FileNotFoundError:
        pass
