"""Rewrite a wheel without the files a GPU check never loads, so a run's wheels fit 64 MiB.

`--drop GLOB` drops the members matching GLOB (fnmatch, on the path inside the
wheel). `--elf-closure MEMBER` drops every shared object and executable that
MEMBER does not load, directly or through another kept one (its NEEDED
entries, matched by file name among the wheel's ELF members). The RECORD
lists exactly the kept files with their hashes, so pip installs the result
as it would the original.

Usage: python scripts/trim_wheel.py WHEEL OUT_DIR [--drop GLOB]... [--elf-closure MEMBER]
"""

from __future__ import annotations

import argparse
import base64
import csv
import fnmatch
import hashlib
import io
import posixpath
import struct
import sys
import zipfile
from pathlib import Path

ELF_MAGIC = b"\x7fELF"
SHT_DYNAMIC, DT_NEEDED = 6, 1


def needed(data: bytes) -> list[str]:
    """The NEEDED sonames of a 64-bit little-endian ELF file (its SHT_DYNAMIC section's
    DT_NEEDED entries, read from the string table that section links)."""
    shoff, shentsize, shnum = struct.unpack_from("<Q10xHH", data, 0x28)
    sections = [
        struct.unpack_from("<4x I 16x QQ I", data, shoff + i * shentsize) for i in range(shnum)
    ]
    names: list[str] = []
    for kind, offset, size, link in sections:
        if kind != SHT_DYNAMIC:
            continue
        strtab = sections[link][1]
        for tag, value in struct.iter_unpack("<qQ", data[offset : offset + size]):
            if tag == DT_NEEDED:
                end = data.index(b"\0", strtab + value)
                names.append(data[strtab + value : end].decode())
    return names


def elf_closure(members: dict[str, bytes], root: str) -> set[str]:
    """The ELF members `root` loads, itself included."""
    by_name: dict[str, str] = {}
    for name, data in members.items():
        if data.startswith(ELF_MAGIC):
            by_name.setdefault(posixpath.basename(name), name)
    kept, todo = set(), [root]
    while todo:
        member = todo.pop()
        if member in kept:
            continue
        kept.add(member)
        todo += [by_name[soname] for soname in needed(members[member]) if soname in by_name]
    return kept


def record_row(name: str, data: bytes) -> list[str]:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [name, f"sha256={digest}", str(len(data))]


def trim(wheel: Path, out_dir: Path, drops: list[str], closure_root: str | None) -> Path:
    with zipfile.ZipFile(wheel) as source:
        members = {info.filename: source.read(info) for info in source.infolist()}
    record = next(name for name in members if name.endswith(".dist-info/RECORD"))
    kept = {name: data for name, data in members.items() if name != record}
    kept = {n: d for n, d in kept.items() if not any(fnmatch.fnmatch(n, g) for g in drops)}
    if closure_root is not None:
        loaded = elf_closure(kept, closure_root)
        kept = {n: d for n, d in kept.items() if not d.startswith(ELF_MAGIC) or n in loaded}
    rows = io.StringIO()  # CSV: some names hold commas
    writer = csv.writer(rows, lineterminator="\n")
    writer.writerows(record_row(n, d) for n, d in kept.items() if not n.endswith("/"))
    writer.writerow([record, "", ""])
    out = out_dir / wheel.name
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as target:
        for name, data in kept.items():
            target.writestr(name, data)
        target.writestr(record, rows.getvalue())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--drop", action="append", default=[], metavar="GLOB")
    parser.add_argument("--elf-closure", metavar="MEMBER")
    args = parser.parse_args()
    out = trim(args.wheel, args.out_dir, args.drop, args.elf_closure)
    mib = 2**20
    print(
        f"{out.name}: {args.wheel.stat().st_size / mib:.1f} -> {out.stat().st_size / mib:.1f} MiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
