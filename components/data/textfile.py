"""Raw lines of a corpus file, gzip or not, refusing encodings the UTF-8 readers cannot decode.

Every line-based reader (`line_readers.read_txt` / `read_jsonl`, the BEIR and QA readers in `beir`)
opens its file through `iter_raw_lines`, so `corpus.jsonl.gz` reads exactly as `corpus.jsonl`:

    gzip         detected by its magic bytes (1f 8b), not the name: a `.jsonl` that is really
                 gzip reads too, and neither sequence can open a valid UTF-8 file by accident
    UTF-16/32    detected by the byte-order mark: the whole file is refused naming the encoding
                 (a per-line "not valid UTF-8" on every line would hide the one fix: re-encode)

Names: `plain_name("corpus.jsonl.gz") == "corpus.jsonl"`, and ids made from a file's stem use
`plain_stem`, so a passage gets the same id from either form of the file. A BEIR folder member is
found by `resolve_member`, which takes `name` or `name.gz` and refuses a folder holding both.
"""

from __future__ import annotations

import gzip
import os
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

from components.data.errors import DataError

GZIP_MAGIC = b"\x1f\x8b"
GZ = ".gz"
# UTF-32-LE's mark starts with UTF-16-LE's: the longer marks are tried first.
WIDE_BOMS: tuple[tuple[bytes, str], ...] = (
    (b"\xff\xfe\x00\x00", "UTF-32-LE"),
    (b"\x00\x00\xfe\xff", "UTF-32-BE"),
    (b"\xff\xfe", "UTF-16-LE"),
    (b"\xfe\xff", "UTF-16-BE"),
)


def is_gzip(path: str | os.PathLike) -> bool:
    """True when the file starts with gzip's magic bytes (whatever its name)."""
    with open(path, "rb") as f:
        return f.read(2) == GZIP_MAGIC


def plain_name(path: str | os.PathLike) -> str:
    """The file name without a trailing `.gz`: what the content is (`c.jsonl.gz` -> `c.jsonl`)."""
    name = Path(path).name
    return name[: -len(GZ)] if name.endswith(GZ) else name


def plain_stem(path: str | os.PathLike) -> str:
    """`c.jsonl.gz` and `c.jsonl` -> `c`: the stem ids are made from, the same for both forms."""
    return Path(plain_name(path)).stem


def plain_suffix(path: str | os.PathLike) -> str:
    """`c.jsonl.gz` -> `.jsonl`: the format suffix under the compression."""
    return Path(plain_name(path)).suffix


def resolve_member(folder: str | os.PathLike, name: str) -> Path:
    """`folder/name` or `folder/name.gz`, whichever exists; `folder/name` when neither does (so the
    caller's "not found" names the expected file). Both existing is ambiguous and refused."""
    plain, packed = Path(folder) / name, Path(folder) / (name + GZ)
    if plain.exists() and packed.exists():
        raise DataError(plain, f"both {plain} and {packed} exist: it is ambiguous which one to read",
                        fix="keep one of them (delete or move the other)")
    return packed if packed.exists() else plain


def wide_encoding(head: bytes) -> str | None:
    """The UTF-16/UTF-32 encoding a byte-order mark at the start of `head` names, else None."""
    return next((enc for bom, enc in WIDE_BOMS if head.startswith(bom)), None)


def _refuse_wide_encoding(path: Path, first_line: bytes) -> None:
    enc = wide_encoding(first_line)
    if enc:
        family = enc.rsplit("-", 1)[0]  # iconv reads the byte order from the mark itself
        raise DataError(path, f"the file is {enc} (it starts with a {enc} byte-order mark), not UTF-8", line=1,
                        fix=f"re-encode it to UTF-8, e.g. `iconv -f {family} -t UTF-8 {path.name} > out`")


@contextmanager
def open_binary(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """The file's bytes, decompressed when it is gzip (by magic bytes)."""
    with open(path, "rb") as raw:
        packed = raw.read(2) == GZIP_MAGIC
        raw.seek(0)
        if not packed:
            yield raw
            return
        with gzip.GzipFile(fileobj=raw, mode="rb") as gz:
            yield gz  # type: ignore[misc]


def iter_raw_lines(path: str | os.PathLike) -> Iterator[tuple[int, bytes]]:
    """(line_number, raw bytes with the newline) for every line of the (decompressed) file.

    A corrupt or truncated gzip stream raises `DataError` at the line it broke on, and a UTF-16/32
    file raises at line 1: either way the caller's per-line decoding never sees garbage.
    """
    path = Path(path)
    packed = is_gzip(path)
    with open_binary(path) as f:
        lineno = 0
        while True:
            try:
                raw = f.readline()
            except (OSError, EOFError, zlib.error) as e:
                if not packed:
                    raise
                raise DataError(path, f"corrupt or truncated gzip data ({type(e).__name__}: {e})", line=lineno + 1,
                                fix=f"re-create the file (`gzip -t {path.name}` checks one), or give it uncompressed") from None
            if not raw:
                return
            lineno += 1
            if lineno == 1:
                _refuse_wide_encoding(path, raw)
            yield lineno, raw
