"""A tar archive written as it is sent: the headers of every member are made first, so the archive's exact length
is known before its first byte, and each file is read in chunks while the bytes go out (no temporary file, no
archive in memory).

The bytes are those ``tarfile.open(mode="w")`` writes for the same members (POSIX.1-2001 pax format, each header and
each file's data padded to 512-byte blocks, two zero blocks at the end, the whole padded to tarfile's 10 KiB record).
The files are opened before the first byte is sent: a file removed meanwhile (a running job's checkpoint retention
renames then deletes old checkpoints) is still read whole through its open handle. :func:`regular_files` lists what
a folder has to send.
"""

import io
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

CHUNK_BYTES = 1024 * 1024
"""How much of a file one chunk of the stream holds."""


@dataclass(frozen=True)
class Member:
    """One regular file of the archive."""

    name: str
    """Its path inside the archive (``/``-separated, relative)."""
    file: BinaryIO
    """Open for reading, at its start; read to ``size`` bytes and closed by :func:`stream`."""
    size: int
    mtime: int

    @classmethod
    def open(cls, name: str, path: Path) -> "Member":
        file = path.open("rb")
        info = os.fstat(file.fileno())
        return cls(name=name, file=file, size=info.st_size, mtime=int(info.st_mtime))

    @classmethod
    def of_bytes(cls, name: str, data: bytes, mtime: int) -> "Member":
        """A member whose content is ``data`` (a file rewritten for the archive)."""
        return cls(name=name, file=io.BytesIO(data), size=len(data), mtime=mtime)

    def header(self) -> bytes:
        """The member's header block(s), as ``tarfile`` writes them (pax extended headers for long names)."""
        info = tarfile.TarInfo(self.name)
        info.size, info.mtime, info.mode = self.size, self.mtime, 0o644
        return info.tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape")


def _padding(size: int, block: int) -> int:
    return -size % block


def archive_size(members: list[Member]) -> int:
    """The exact length in bytes of :func:`stream` of ``members``."""
    body = sum(len(member.header()) + member.size + _padding(member.size, tarfile.BLOCKSIZE) for member in members)
    body += 2 * tarfile.BLOCKSIZE  # the end-of-archive marker
    return body + _padding(body, tarfile.RECORDSIZE)


def stream(members: list[Member]) -> Iterator[bytes]:
    """The tar archive of ``members``, in chunks of at most :data:`CHUNK_BYTES` of file data; closes every file, also
    when the stream is abandoned. A file shorter than its size at opening ends the stream with an error (the
    receiver sees a body shorter than its announced length), never a silently wrong archive."""
    try:
        written = 0
        for member in members:
            header = member.header()
            yield header
            left = member.size
            while left:
                chunk = member.file.read(min(left, CHUNK_BYTES))
                if not chunk:
                    raise OSError(f"{member.name} shrank while it was being sent ({left} bytes missing)")
                left -= len(chunk)
                yield chunk
            member.file.close()
            pad = _padding(member.size, tarfile.BLOCKSIZE)
            if pad:
                yield bytes(pad)
            written += len(header) + member.size + pad
        end = 2 * tarfile.BLOCKSIZE
        yield bytes(end + _padding(written + end, tarfile.RECORDSIZE))
    finally:
        for member in members:
            member.file.close()


def regular_files(folder: Path) -> list[tuple[str, Path]]:
    """The regular files under ``folder`` as (``/``-separated path relative to it, path), sorted; no symlinks, and
    none of the folders behind symlinked folders. Empty when ``folder`` is not a folder."""
    if folder.is_symlink() or not folder.is_dir():
        return []
    found = []
    for dirpath, _, filenames in os.walk(folder):  # symlinked folders are listed, never entered
        for filename in filenames:
            path = Path(dirpath) / filename
            if path.is_file() and not path.is_symlink():
                found.append((path.relative_to(folder).as_posix(), path))
    return sorted(found)
