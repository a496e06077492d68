"""What ptxas gave each kernel of a cubin: registers a thread, stack frame, shared memory;
and (`main_loop`, from nvdisasm's listing) the instructions of its longest loop.

A decode kernel that keeps few loads in flight is often one the compiler kept to few
registers: written as an unrolled scalar sum, `hc_pre`, the router and the indexer's
queries compiled to 30-35 registers and their DRAM round trips stood in turn. These numbers
live in the cubin itself, so they can be read here, on the cubins `kernel_cache.fill`
writes for the H200 (NVRTC, sm_90a), without a GPU.

A cubin is an ELF64 file. For each kernel `f`:
- the section `.text.f` holds its code;
- the section `.nv.info` holds attribute records of 4 bytes, or 4 bytes and a payload
  (format 4: a 16-bit payload size). REGCOUNT (0x2f) and FRAME_SIZE (0x11) carry a
  symbol index and a 32-bit value;
- the section `.nv.shared.f`, when the kernel declares static shared memory, has its size
  (with the driver's reserved 1 KB on sm_90, which is left out here, as ncu does).
The frame is local memory a thread: spilled registers and arrays indexed at run time.
"""

from __future__ import annotations

import re
import struct
from collections import Counter
from dataclasses import dataclass

_EIFMT_SVAL = 4                  # a record with a 16-bit payload size, then the payload
_EIATTR_FRAME_SIZE = 0x11
_EIATTR_REGCOUNT = 0x2F
_RESERVED_SHARED = 1024          # bytes of a block's shared memory the driver keeps (sm_90)
_SECTION = struct.Struct("<IIQQQQIIQQ")      # Elf64_Shdr
_SYMBOL = struct.Struct("<IBBHQQ")           # Elf64_Sym


@dataclass(frozen=True)
class KernelResources:
    """One kernel's resources as ptxas allocated them."""

    name: str            # the kernel's (mangled) symbol
    registers: int       # a thread's registers
    frame_bytes: int     # a thread's stack frame in local memory (spills, run-time-indexed arrays)
    shared_bytes: int    # a block's static shared memory


class CubinError(ValueError):
    """A file that is not a cubin this module can read: names the file, field and offset."""


def kernel_resources(data: bytes, source: str = "cubin") -> list[KernelResources]:
    """The resources of every kernel in a cubin's bytes (`source` names the file in errors)."""

    def unpack(layout: struct.Struct | str, offset: int, field: str) -> tuple:
        size = layout.size if isinstance(layout, struct.Struct) else struct.calcsize(layout)
        if offset < 0 or offset + size > len(data):
            raise CubinError(f"{source}: {field} at offset {offset} runs past the end ({len(data)} bytes)")
        return layout.unpack_from(data, offset) if isinstance(layout, struct.Struct) \
            else struct.unpack_from(layout, data, offset)

    if data[:4] != b"\x7fELF" or len(data) < 64 or data[4] != 2 or data[5] != 1:
        raise CubinError(f"{source}: not a little-endian ELF64 file (offset 0)")
    (section_offset,) = unpack("<Q", 0x28, "e_shoff")
    entry_size, count, names_index = unpack("<HHH", 0x3A, "e_shentsize/e_shnum/e_shstrndx")
    if entry_size != _SECTION.size or names_index >= count:
        raise CubinError(f"{source}: section header size {entry_size}, names section {names_index} of {count} "
                         f"(offset 0x3a)")
    sections = [unpack(_SECTION, section_offset + i * entry_size, f"section header {i}") for i in range(count)]

    def name_at(table: int, offset: int, field: str) -> str:
        start = sections[table][4] + offset
        end = data.find(b"\0", start, sections[table][4] + sections[table][5])
        if start >= len(data) or end < 0:
            raise CubinError(f"{source}: {field} name at offset {start} is not terminated in its table")
        return data[start:end].decode("utf-8", errors="replace")

    named = [(name_at(names_index, s[0], f"section {i}"), s) for i, s in enumerate(sections)]
    symbols: list[str] = []
    for name, s in named:
        if name == ".symtab":
            strings = s[6]
            if strings >= count:
                raise CubinError(f"{source}: .symtab names section {strings} of {count}")
            symbols = [name_at(strings, unpack(_SYMBOL, s[4] + k * _SYMBOL.size, f"symbol {k}")[0], f"symbol {k}")
                       for k in range(s[5] // _SYMBOL.size)]
    registers: dict[str, int] = {}
    frames: dict[str, int] = {}
    for name, s in named:
        if name != ".nv.info":
            continue
        offset, end = s[4], s[4] + s[5]
        while offset < end:
            fmt, attribute, size = unpack("<BBH", offset, ".nv.info record")
            if fmt == _EIFMT_SVAL:
                if attribute in (_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE) and size >= 8:
                    index, value = unpack("<II", offset + 4, ".nv.info payload")
                    if index >= len(symbols):
                        raise CubinError(f"{source}: .nv.info record at offset {offset} names symbol {index} "
                                         f"of {len(symbols)}")
                    (registers if attribute == _EIATTR_REGCOUNT else frames)[symbols[index]] = value
                offset += 4 + size
            else:
                offset += 4
    # On sm_90 a kernel's `.nv.shared.f` also spans the 1 KB the driver reserves at the start
    # of every block's shared memory (a `.nv.shared.reserved.*` section of size 0 says so;
    # ncu lists it apart, as "Driver Shared Memory Per Block").
    reserved = _RESERVED_SHARED if any(name.startswith(".nv.shared.reserved.") for name, _ in named) else 0
    shared = {name.removeprefix(".nv.shared."): max(s[5] - reserved, 0) for name, s in named
              if name.startswith(".nv.shared.") and not name.startswith(".nv.shared.reserved.")}
    kernels = [name.removeprefix(".text.") for name, _ in named if name.startswith(".text.")]
    return [KernelResources(k, registers.get(k, 0), frames.get(k, 0), shared.get(k, 0)) for k in kernels]


# nvdisasm's listing: `.L_x_12:` labels, then `/*0a40*/  @!P0 BRA `(.L_x_12) ;` lines.
_LABEL = re.compile(r"^\s*\.(L_x_\d+):")
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\b.*?\.(L_x_\d+)")


def main_loop(listing: str) -> Counter[str]:
    """The opcodes of the longest loop in a kernel's SASS (`nvdisasm -c` of its cubin): the
    instructions from a label to a branch back to it, counted by opcode with its modifiers
    (`LDG.E.128`), predicates dropped. A decode kernel's weights loop is its longest; its
    instructions a weight say how far it is from issue-bound (empty when there is no loop)."""
    labels: dict[str, int] = {}
    pending: list[str] = []
    code: list[tuple[int, str]] = []
    for line in listing.splitlines():
        if label := _LABEL.match(line):
            pending.append(label.group(1))
        elif found := _INSTRUCTION.match(line):
            address = int(found.group(1), 16)
            labels.update(dict.fromkeys(pending, address))
            pending = []
            code.append((address, re.sub(r"^@!?U?P\w+\s+", "", found.group(2))))
    longest: list[str] = []
    for address, text in code:
        branch = _BRANCH.search(text)
        start = labels.get(branch.group(1)) if branch else None
        if start is not None and start <= address:
            body = [t.split()[0] for a, t in code if start <= a <= address]
            if len(body) > len(longest):
                longest = body
    return Counter(longest)
