"""The CLI's SSE parser (events, ids, multi-line data, comments), and how ``rlhf download`` unpacks a model archive:
its one top folder stripped, anything a model folder never holds refused. (The command end to end:
tests/jobs/test_download.py.)"""

import io
import tarfile
from pathlib import Path

import pytest

from jobs.client import ChunkReader, UnsafeArchiveError, parse_sse, unpack_model


def test_parse_sse_messages() -> None:
    lines = [
        ": heartbeat",
        "",
        "event: status",
        "id: 0-1",
        'data: {"status": "running"}',
        "",
        "event: metrics",
        "id: 5-1",
        'data: {"step": 1,',
        'data:  "metrics": {"loss/sft": 2.5}}',
        "",
        "event: end",
        "data: {}",
        "",
    ]
    messages = list(parse_sse(iter(lines)))
    assert [(m.event, m.id) for m in messages] == [("status", "0-1"), ("metrics", "5-1"), ("end", "5-1")]
    assert messages[0].data == {"status": "running"}
    assert messages[1].data == {"step": 1, "metrics": {"loss/sft": 2.5}}


def tar_of(*members: tuple[tarfile.TarInfo, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for info, data in members:
            info.size = len(data) if info.isfile() else 0
            tar.addfile(info, io.BytesIO(data) if info.isfile() else None)
    return out.getvalue()


def file_member(name: str) -> tarfile.TarInfo:
    return tarfile.TarInfo(name)


def link_member(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


def chunks(data: bytes, size: int = 700) -> ChunkReader:
    return ChunkReader(iter([data[i : i + size] for i in range(0, len(data), size)]))


def test_a_model_archive_unpacks_without_its_top_folder(tmp_path: Path) -> None:
    top = tarfile.TarInfo("job_x")
    top.type = tarfile.DIRTYPE
    data = tar_of(
        (top, b""), (file_member("job_x/config.json"), b"{}"), (file_member("job_x/adapter/a.bin"), b"a" * 3000)
    )
    unpack_model(chunks(data), tmp_path / "out")
    assert sorted(p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*")) == [
        "adapter",
        "adapter/a.bin",
        "config.json",
    ]
    assert (tmp_path / "out" / "adapter" / "a.bin").read_bytes() == b"a" * 3000


@pytest.mark.parametrize(
    "member",
    [
        file_member("job_x/../../escaped"),
        file_member("/tmp/absolute"),
        file_member("other/config.json"),  # outside the archive's one top folder
        file_member("config.json"),  # a file at the top, not in a folder
        link_member("job_x/config.json", "/etc/passwd"),
        link_member("job_x/config.json", "job_x/model.safetensors", tarfile.LNKTYPE),
        link_member("job_x/dev", "", tarfile.CHRTYPE),
    ],
    ids=["dotdot", "absolute", "second-top", "top-file", "symlink", "hardlink", "device"],
)
def test_an_archive_member_a_model_never_holds_is_refused(tmp_path: Path, member: tarfile.TarInfo) -> None:
    data = tar_of((file_member("job_x/model.safetensors"), b"w"), (member, b"x"))
    with pytest.raises(UnsafeArchiveError):
        unpack_model(chunks(data), tmp_path / "a" / "out")
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == ["model.safetensors"]  # nothing outside


def test_a_truncated_archive_is_an_error(tmp_path: Path) -> None:
    data = tar_of((file_member("job_x/model.safetensors"), b"w" * 5000))
    with pytest.raises(tarfile.ReadError):
        unpack_model(chunks(data[:3000]), tmp_path)


def gnu_sparse_member(name: str, data: bytes, apparent: int) -> bytes:
    """A GNU sparse member (type ``S``; GNU tar's ``--sparse``, which tarfile reads but cannot write): ``data`` at
    offset 0 of a file of ``apparent`` bytes, the rest a hole. Its header's fields, by offset: the sparse map at 386
    (offset, length: 12 octal digits each), the real size at 483."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    header = bytearray(info.tobuf(format=tarfile.GNU_FORMAT))
    header[156:157] = tarfile.GNUTYPE_SPARSE
    header[386:410] = b"%011o\0%011o\0" % (0, len(data))
    header[483:495] = b"%011o\0" % apparent
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header[:512])
    return bytes(header) + data.ljust(-(-len(data) // 512) * 512, b"\0")


def test_a_sparse_member_is_refused(tmp_path: Path) -> None:
    """Issue 39, item 4.13: a GNU sparse member unpacked to 1 GiB from a few KB (16 GiB in the probe)."""
    normal = tar_of((file_member("job_x/config.json"), b"{}"))[:1024]  # its header and data, no end blocks
    data = normal + gnu_sparse_member("job_x/model.safetensors", b"w" * 100, 2**30) + b"\0" * 1024
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert [m.name for m in tar if m.issparse()] == ["job_x/model.safetensors"]  # the archive is what it says
    with pytest.raises(UnsafeArchiveError, match=r"'job_x/model\.safetensors' is a sparse file"):
        unpack_model(chunks(data), tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()
