"""The disk tier: one pack file per streamed layer, read around the page cache.

File format (``layer_0007.pack``)::

    [header: MAGIC, u32 length, JSON, zero padding to a multiple of 4096]
    [payload: the packed layer (see layout.py), padded to a multiple of 4096]

The JSON names the layer, the compute dtype, the quantization, the byte layout, the
fingerprint of the safetensors files it was built from, and the CRC32 of the
payload. A pack whose fingerprint or layout no longer matches is rebuilt; one whose
size or header is wrong is reported as damaged, naming the file; the CRC is checked
the first time each layer is read in a session.

Reads use O_DIRECT into block-aligned buffers, so the page cache never holds the
weights: a model larger than RAM streams, and measured speeds are the disk's. Where
the file system refuses O_DIRECT (tmpfs, some network mounts) the reader falls back
to buffered reads followed by posix_fadvise(DONTNEED), and says so.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from minions_local.core.errors import MemoryPlanError, ModelLoadError
from minions_local.offload.layout import BLOCK, LayerLayout, round_up

log = logging.getLogger(__name__)

MAGIC = b"MLPACK01"
FORMAT_VERSION = 1
READ_CHUNK = 16 << 20
"""Bytes per read call: large enough to reach the disk's sequential speed."""


@dataclass(frozen=True, slots=True)
class PackFile:
    """A verified layer pack on disk."""

    path: Path
    layer: int
    layout: LayerLayout
    payload_offset: int
    crc32: int

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    @property
    def padded_nbytes(self) -> int:
        return self.layout.padded_nbytes


def pack_name(layer: int) -> str:
    return f"layer_{layer:04d}.pack"


def _damaged(path: Path, what: str) -> ModelLoadError:
    return ModelLoadError(
        f"layer pack {path} is damaged ({what}). Delete it (or its folder {path.parent}) "
        "and load the model again to rebuild it from the safetensors files."
    )


def read_header(path: Path) -> dict:
    """The header's JSON, after checking magic, length and file size; errors name the file."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC) + 4)
            if len(head) < len(MAGIC) + 4 or head[: len(MAGIC)] != MAGIC:
                raise _damaged(path, "not a layer pack: bad magic bytes")
            (length,) = struct.unpack("<I", head[len(MAGIC) :])
            if length > 64 << 20:
                raise _damaged(path, f"header length {length} is implausible")
            body = f.read(length)
            size = os.fstat(f.fileno()).st_size
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # and its read-ahead
    except OSError as e:
        raise ModelLoadError(f"cannot read layer pack {path}: {e.strerror}. Check the disk and permissions.") from e
    if len(body) < length:
        raise _damaged(path, "truncated inside the header")
    try:
        header = json.loads(body)
        header["layout"] = LayerLayout.from_json(header["layout"])
        payload_offset = int(header["payload_offset"])
        padded = header["layout"].padded_nbytes
    except (ValueError, KeyError, TypeError) as e:
        raise _damaged(path, f"unreadable header: {e}") from e
    if size != payload_offset + padded:
        raise _damaged(path, f"{size} bytes on disk, expected {payload_offset + padded}; truncated or overwritten")
    return header


def open_pack(path: Path, *, layer: int, layout: LayerLayout, fingerprint: str) -> PackFile | None:
    """The pack at path if it is up to date; None if missing or stale (rebuild it)."""
    if not path.exists():
        return None
    header = read_header(path)
    if header.get("format") != FORMAT_VERSION or header.get("fingerprint") != fingerprint:
        log.info("layer pack %s is out of date; rebuilding it", path)
        return None
    if header.get("layer") != layer or header["layout"] != layout:
        log.info("layer pack %s has another layout; rebuilding it", path)
        return None
    return PackFile(path, layer, layout, int(header["payload_offset"]), int(header["crc32"]))


def check_writable(folder: Path, need_bytes: int) -> None:
    """Fail early, naming the folder, if the disk tier cannot be written there."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".write-probe"
        _create_file(probe).close()
        probe.unlink()
    except OSError as e:
        raise MemoryPlanError(
            f"the disk tier cannot write its layer packs to {folder}: {e.strerror or e}. "
            "Point cache_dir (the profile's disk path) at a writable folder on a local disk."
        ) from e
    free = shutil.disk_usage(folder).free
    if free < need_bytes:
        raise MemoryPlanError(
            f"the disk tier needs {need_bytes / 1e9:.2f} GB for layer packs in {folder}, but only "
            f"{free / 1e9:.2f} GB is free there. Free space, choose another cache_dir, or keep more "
            "layers in RAM / quantize them (quant='int4' streams ~0.53 bytes per parameter)."
        )


def _create_file(path: Path):
    return open(path, "wb")


def write_pack(path: Path, *, layer: int, layout: LayerLayout, payload: torch.Tensor, fingerprint: str) -> PackFile:
    """Write one pack atomically (temp file + rename), flushed and dropped from the page cache."""
    data = payload[: layout.padded_nbytes].numpy()
    crc = zlib.crc32(memoryview(data)[: layout.nbytes])
    header = {
        "format": FORMAT_VERSION,
        "layer": layer,
        "fingerprint": fingerprint,
        "layout": layout.to_json(),
        "crc32": crc,
        "payload_offset": 0,
    }
    body = json.dumps(header).encode()
    payload_offset = round_up(len(MAGIC) + 4 + len(body) + 32, BLOCK)
    header["payload_offset"] = payload_offset
    body = json.dumps(header).encode()
    head = MAGIC + struct.pack("<I", len(body)) + body
    head += b"\0" * (payload_offset - len(head))
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # two processes may pack the same model
    try:
        with _create_file(tmp) as f:
            f.write(head)
            f.write(memoryview(data))
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.errno == errno.ENOSPC:
            raise MemoryPlanError(
                f"the disk filled up while writing {path}. Free space in {path.parent} or set "
                "cache_dir to a disk with room for the layer packs."
            ) from e
        raise MemoryPlanError(
            f"cannot write layer pack {path}: {e.strerror or e}. Point cache_dir at a writable folder."
        ) from e
    return PackFile(path, layer, layout, payload_offset, crc)


def open_direct(path: Path) -> int:
    """An O_DIRECT descriptor; OSError(EINVAL) where the file system refuses it."""
    if not hasattr(os, "O_DIRECT"):
        raise OSError(errno.EINVAL, "O_DIRECT is not available on this platform")
    return os.open(path, os.O_RDONLY | os.O_DIRECT)


class PackReader:
    """Reads pack payloads into block-aligned buffers without filling the page cache."""

    def __init__(self, pack: PackFile) -> None:
        self.pack = pack
        self.direct = True
        self.verified = False
        try:
            self.fd = open_direct(pack.path)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise ModelLoadError(f"cannot open layer pack {pack.path}: {e.strerror}") from e
            self._reopen_buffered()

    def _reopen_buffered(self) -> None:
        self.direct = False
        self.fd = os.open(self.pack.path, os.O_RDONLY)

    def read_into(self, buffer: torch.Tensor) -> None:
        """Fill buffer[:padded_nbytes] with the payload (buffer must be BLOCK-aligned)."""
        self.read_part(buffer, 0, self.pack.padded_nbytes)
        self.check(buffer)

    def parts(self, n: int) -> list[tuple[int, int]]:
        """The payload split into n block-aligned byte ranges, for parallel reads."""
        total = self.pack.padded_nbytes
        step = max(BLOCK, round_up(-(-total // max(1, n)), BLOCK))
        return [(a, min(total, a + step)) for a in range(0, total, step)]

    def read_part(self, buffer: torch.Tensor, start: int, stop: int) -> None:
        """Read payload bytes [start, stop) into the same range of buffer."""
        view = memoryview(buffer[start:stop].numpy())
        try:
            self._read(view, start, stop - start)
        except OSError as e:
            if e.errno == errno.EINVAL and self.direct:
                log.warning("O_DIRECT refused for %s; falling back to buffered reads + fadvise(DONTNEED)",
                            self.pack.path)
                os.close(self.fd)
                self._reopen_buffered()
                self._read(view, start, stop - start)
            else:
                raise ModelLoadError(f"reading layer pack {self.pack.path} failed: {e.strerror or e}") from e

    def check(self, buffer: torch.Tensor) -> None:
        """Verify the payload's checksum the first time this layer is read."""
        if self.verified:
            return
        if zlib.crc32(memoryview(buffer[: self.pack.nbytes].numpy())) != self.pack.crc32:
            raise _damaged(self.pack.path, "payload checksum mismatch")
        self.verified = True

    def _read(self, view: memoryview, start: int, n: int) -> None:
        base = self.pack.payload_offset + start
        done = 0
        while done < n:
            got = os.preadv(self.fd, [view[done : min(n, done + READ_CHUNK)]], base + done)
            if got <= 0:
                raise _damaged(self.pack.path, f"file ended {n - done} bytes early")
            done += got
        if not self.direct:
            os.posix_fadvise(self.fd, base, n, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
