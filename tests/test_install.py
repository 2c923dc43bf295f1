"""Tests of the installed package itself: the search path baked into the `_C` extension, and the
torch version the package declares. They need no GPU.

The ELF reader below is plain `struct`: it follows the dynamic loader (program headers, PT_DYNAMIC,
DT_STRTAB) rather than section names, so it reads what the loader would read.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import struct
from pathlib import Path

import pytest

PT_LOAD, PT_DYNAMIC = 1, 2
DT_NULL, DT_STRTAB, DT_STRSZ, DT_RPATH, DT_RUNPATH = 0, 5, 10, 15, 29


def elf_search_paths(data: bytes) -> dict[str, list[str]]:
    """The DT_RPATH and DT_RUNPATH entries of an ELF shared object, as {"RPATH": [...], "RUNPATH": [...]}
    (a tag that is absent gives an empty list). ELF32/ELF64, either byte order."""
    if data[:4] != b"\x7fELF":
        raise ValueError("not an ELF file")
    ei_class, ei_data = data[4], data[5]
    if ei_class not in (1, 2) or ei_data not in (1, 2):
        raise ValueError(f"unknown ELF class {ei_class} or data encoding {ei_data}")
    end = "<" if ei_data == 1 else ">"
    if ei_class == 2:  # ELF64
        e_phoff, = struct.unpack_from(end + "Q", data, 0x20)
        e_phentsize, e_phnum = struct.unpack_from(end + "HH", data, 0x36)
        phdr = end + "IIQQQQQQ"  # p_type p_flags p_offset p_vaddr p_paddr p_filesz p_memsz p_align
        dyn = end + "qQ"

        def ph(i):
            p_type, _, off, vaddr, _, filesz, _, _ = struct.unpack_from(phdr, data, e_phoff + i * e_phentsize)
            return p_type, off, vaddr, filesz
    else:  # ELF32
        e_phoff, = struct.unpack_from(end + "I", data, 0x1C)
        e_phentsize, e_phnum = struct.unpack_from(end + "HH", data, 0x2A)
        phdr = end + "IIIIIIII"  # p_type p_offset p_vaddr p_paddr p_filesz p_memsz p_flags p_align
        dyn = end + "iI"

        def ph(i):
            p_type, off, vaddr, _, filesz, _, _, _ = struct.unpack_from(phdr, data, e_phoff + i * e_phentsize)
            return p_type, off, vaddr, filesz

    headers = [ph(i) for i in range(e_phnum)]
    dynamic = [h for h in headers if h[0] == PT_DYNAMIC]
    if not dynamic:
        return {"RPATH": [], "RUNPATH": []}  # statically linked: no search path at all
    _, dyn_off, _, dyn_size = dynamic[0]

    entries = []
    size = struct.calcsize(dyn)
    for pos in range(dyn_off, dyn_off + dyn_size - size + 1, size):
        tag, val = struct.unpack_from(dyn, data, pos)
        if tag == DT_NULL:
            break
        entries.append((tag, val))

    strtab_vaddr = next((v for t, v in entries if t == DT_STRTAB), None)
    if strtab_vaddr is None:
        raise ValueError("dynamic section without DT_STRTAB")
    # DT_STRTAB holds a virtual address: map it to a file offset through the PT_LOAD segments.
    for p_type, off, vaddr, filesz in headers:
        if p_type == PT_LOAD and vaddr <= strtab_vaddr < vaddr + filesz:
            strtab = off + strtab_vaddr - vaddr
            break
    else:
        raise ValueError(f"DT_STRTAB {strtab_vaddr:#x} lies in no PT_LOAD segment")

    def string(offset: int) -> str:
        start = strtab + offset
        return data[start:data.index(b"\0", start)].decode()

    names = {DT_RPATH: "RPATH", DT_RUNPATH: "RUNPATH"}
    paths: dict[str, list[str]] = {"RPATH": [], "RUNPATH": []}
    for tag, val in entries:
        if tag in names:
            paths[names[tag]].extend(string(val).split(":"))
    return paths


def not_origin_relative(paths: dict[str, list[str]]) -> list[str]:
    """Entries the loader would resolve outside the package's own install: anything that does not
    start with $ORIGIN (absolute paths, relative ones taken from the working directory, and the
    empty entry, which means the working directory)."""
    return [f"{tag} {entry!r}" for tag, entries in paths.items() for entry in entries
            if not re.fullmatch(r"(\$ORIGIN|\$\{ORIGIN\})(/.*)?", entry)]


def installed_extension() -> Path:
    spec = importlib.util.find_spec("pydatacopy._C")
    assert spec is not None and spec.origin, "pydatacopy._C not found"
    path = Path(spec.origin).resolve()
    try:
        files = importlib.metadata.files("pydatacopy") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"pydatacopy is not installed (its _C comes from {path}); these tests check the install")
    installed = {Path(f.locate()).resolve() for f in files}
    assert path in installed, f"the imported {path} is not the file pip installed for pydatacopy"
    return path


def test_installed_module_search_path_is_origin_relative():
    path = installed_extension()
    paths = elf_search_paths(path.read_bytes())
    entries = paths["RPATH"] + paths["RUNPATH"]
    assert entries, f"{path} has no RUNPATH: it could not find libnvshmem_host.so.3 in the NVSHMEM wheel"
    bad = not_origin_relative(paths)
    assert not bad, (f"{path} searches for libraries outside its install (a build folder pip deleted "
                     f"can be recreated by anyone): {bad}")


def test_installed_module_finds_nvshmem_through_its_search_path():
    # The $ORIGIN entry must point at the NVSHMEM wheel installed beside the package.
    path = installed_extension()
    paths = elf_search_paths(path.read_bytes())
    found = [e for e in paths["RPATH"] + paths["RUNPATH"]
             if (Path(re.sub(r"^(\$ORIGIN|\$\{ORIGIN\})", str(path.parent), e)) / "libnvshmem_host.so.3").exists()]
    assert found, f"no RUNPATH entry of {path} ({paths}) holds libnvshmem_host.so.3"


def _crafted_elf64(runpath: bytes, tag: int = DT_RUNPATH, vaddr_base: int = 0x1000) -> bytes:
    """A minimal little-endian ELF64 shared object: one PT_LOAD over the whole file mapped at
    vaddr_base, one PT_DYNAMIC, a string table holding runpath."""
    ehdr_size, phdr_size = 64, 56
    strtab = b"\0" + runpath + b"\0"
    strtab_off = ehdr_size + 2 * phdr_size
    dyn_off = strtab_off + len(strtab) + (-len(strtab)) % 8
    dynamic = struct.pack("<qQqQqQqQ", DT_STRTAB, vaddr_base + strtab_off, DT_STRSZ, len(strtab), tag, 1, DT_NULL, 0)
    total = dyn_off + len(dynamic)
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    ehdr = ident + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, ehdr_size, 0, 0, ehdr_size, phdr_size, 2, 64, 0, 0)
    load = struct.pack("<IIQQQQQQ", PT_LOAD, 5, 0, vaddr_base, vaddr_base, total, total, 0x1000)
    dyn = struct.pack("<IIQQQQQQ", PT_DYNAMIC, 6, dyn_off, vaddr_base + dyn_off, vaddr_base + dyn_off,
                      len(dynamic), len(dynamic), 8)
    out = ehdr + load + dyn + strtab
    return out + bytes(dyn_off - len(out)) + dynamic


@pytest.mark.parametrize("runpath,bad", [
    # what the module carried before: the wheel beside it, and pip's deleted build-isolation folder
    (b"$ORIGIN/../nvidia/nvshmem/lib:/tmp/pip-build-env-x1y2/overlay/lib/python3.11/site-packages/nvidia/nvshmem/lib",
     ["RUNPATH '/tmp/pip-build-env-x1y2/overlay/lib/python3.11/site-packages/nvidia/nvshmem/lib'"]),
    (b"$ORIGIN/../nvidia/nvshmem/lib", []),
    (b"${ORIGIN}/lib:$ORIGIN", []),
    (b"$ORIGINAL/lib", ["RUNPATH '$ORIGINAL/lib'"]),
    (b"lib", ["RUNPATH 'lib'"]),  # relative to the working directory
    (b"$ORIGIN/lib:", ["RUNPATH ''"]),  # the empty entry is the working directory
])
def test_search_path_check_on_crafted_elf(runpath, bad):
    paths = elf_search_paths(_crafted_elf64(runpath))
    assert paths == {"RPATH": [], "RUNPATH": runpath.decode().split(":")}
    assert not_origin_relative(paths) == bad


def test_search_path_check_reads_old_style_rpath():
    paths = elf_search_paths(_crafted_elf64(b"/opt/nvshmem/lib", tag=DT_RPATH))
    assert paths == {"RPATH": ["/opt/nvshmem/lib"], "RUNPATH": []}
    assert not_origin_relative(paths) == ["RPATH '/opt/nvshmem/lib'"]


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.match(r"\d+(?:\.\d+)*", version).group().split("."))


def test_declared_torch_lower_bound_is_met():
    import torch

    try:
        requires = importlib.metadata.requires("pydatacopy") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("pydatacopy is not installed")
    torch_reqs = [r for r in requires if re.match(r"torch\s*[<>=!~(;\[]", r) or r.strip() == "torch"]
    assert len(torch_reqs) == 1, requires
    bound = re.search(r">=\s*([0-9.]+)", torch_reqs[0])
    # .ci/run reads this bound from pyproject.toml and tests exactly that torch ("oldest").
    assert bound, f"pydatacopy declares no torch lower bound: {torch_reqs[0]!r}"
    assert _version_tuple(torch.__version__) >= _version_tuple(bound.group(1)), torch.__version__
