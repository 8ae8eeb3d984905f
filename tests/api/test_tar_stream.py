"""api.tar_stream: the streamed archive is byte for byte what ``tarfile`` writes for the same files, its announced
length is exact, files go out in bounded chunks, and a file that shrinks while it is sent breaks the stream."""

import io
import tarfile
from pathlib import Path

import pytest

from api import tar_stream
from api.tar_stream import Member, archive_size, stream

SIZES = {"empty": 0, "one-block": 512, "odd": 1000, "several-chunks": 5000}


def files(folder: Path) -> dict[str, Path]:
    """Files of awkward sizes, and a name long enough to need a pax header."""
    paths = {}
    for name, size in {**SIZES, "d" * 60 + "/" + "n" * 90: 7}.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes(range(256)) * (size // 256) + bytes(size % 256))
        paths[f"root/{name}"] = path
    return paths


def test_the_stream_is_what_tarfile_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tar_stream, "CHUNK_BYTES", 2048)
    paths = files(tmp_path)
    members = [Member.open(name, path) for name, path in paths.items()]
    expected_size = archive_size(members)
    chunks = list(stream(members))
    streamed = b"".join(chunks)

    reference = io.BytesIO()
    with tarfile.open(fileobj=reference, mode="w") as tar:
        for name, path in paths.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = path.stat().st_size, int(path.stat().st_mtime), 0o644
            with path.open("rb") as f:
                tar.addfile(info, f)
    assert streamed == reference.getvalue()
    assert len(streamed) == expected_size
    assert max(len(chunk) for chunk in chunks[:-1]) <= 2048  # file data in chunks, never a whole file at once
    assert not chunks[-1].strip(b"\0") and len(chunks[-1]) <= tarfile.RECORDSIZE + 2 * tarfile.BLOCKSIZE  # the end
    assert all(member.file.closed for member in members)
    with tarfile.open(fileobj=io.BytesIO(streamed)) as tar:
        assert tar.getnames() == list(paths)


def test_a_file_that_shrinks_breaks_the_stream(tmp_path: Path) -> None:
    path = tmp_path / "weights"
    path.write_bytes(b"x" * 3000)
    members = [Member.open("root/weights", path)]
    path.write_bytes(b"x" * 100)  # truncated in place after it was opened
    with pytest.raises(OSError, match="shrank"):
        b"".join(stream(members))
    assert members[0].file.closed


def test_a_file_removed_after_opening_is_sent_whole(tmp_path: Path) -> None:
    path = tmp_path / "weights"
    path.write_bytes(b"w" * 1500)
    members = [Member.open("root/weights", path)]
    path.unlink()  # what checkpoint retention does to an old checkpoint
    with tarfile.open(fileobj=io.BytesIO(b"".join(stream(members)))) as tar:
        member = tar.extractfile("root/weights")
        assert member is not None and member.read() == b"w" * 1500
