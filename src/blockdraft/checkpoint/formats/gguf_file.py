"""A GGUF file as the bytes its writer will put on disk, known before it is written: the metadata
entries and tensors (`Entry`, arrays) go through `check_values` (every integer inside its GGUF
type; a value out of range is a one-line error, not a `struct.error` halfway through the file),
`file_bytes` (the exact size, tokenizer arrays included, for the free-space check) and then
`write_file`, in that order, from the same lists.

Layout (GGUF v3, little-endian, as gguf-py 0.17+ writes it): a 24-byte header (magic, version,
tensor count, entry count); each entry as its key (u64 length + UTF-8), u32 type and value
(strings: u64 length + bytes; arrays: u32 item type, u64 count, items); each tensor's info (name,
u32 dims, u64 per dim, u32 type, u64 offset); padding to the alignment; then each tensor's data,
padded to the alignment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

ALIGNMENT = 32  # gguf's GGUF_DEFAULT_ALIGNMENT; nothing here sets general.alignment


@dataclass(frozen=True)
class Entry:
    key: str
    value: Any
    vtype: Any  # gguf.GGUFValueType
    sub: Any = None  # the item type of an ARRAY


def _kinds():
    from gguf import GGUFValueType as T

    sizes = {T.UINT8: 1, T.INT8: 1, T.UINT16: 2, T.INT16: 2, T.UINT32: 4, T.INT32: 4, T.FLOAT32: 4, T.BOOL: 1,
             T.UINT64: 8, T.INT64: 8, T.FLOAT64: 8}
    ranges = {t: (0, 2 ** (8 * sizes[t]) - 1) for t in (T.UINT8, T.UINT16, T.UINT32, T.UINT64)}
    ranges.update({t: (-2 ** (8 * sizes[t] - 1), 2 ** (8 * sizes[t] - 1) - 1) for t in (T.INT8, T.INT16, T.INT32,
                                                                                         T.INT64)})
    return T, sizes, ranges


def check_values(entries: list[Entry]) -> None:
    """Every integer inside its GGUF type's range, every float finite; else a ValueError naming the key."""
    import math

    T, _, ranges = _kinds()
    for e in entries:
        kind = e.sub if e.vtype == T.ARRAY else e.vtype
        values = e.value if e.vtype == T.ARRAY else [e.value]
        if kind in ranges:
            low, high = ranges[kind]
            bad = [v for v in values if not low <= int(v) <= high]
            if bad:
                raise ValueError(f"the GGUF field {e.key} = {bad[0]} does not fit its type {kind.name} "
                                 f"([{low}, {high}]); the drafter's config holds a value llama.cpp cannot read")
        elif kind in (T.FLOAT32, T.FLOAT64) and not all(math.isfinite(float(v)) for v in values):
            raise ValueError(f"the GGUF field {e.key} is not finite")


def value_bytes(value, vtype, sub=None) -> int:
    """Bytes of one value as the writer packs it (without its type tag)."""
    T, sizes, _ = _kinds()
    if vtype == T.STRING:
        return 8 + len(value.encode("utf-8") if isinstance(value, str) else bytes(value))
    if vtype == T.ARRAY:
        if sub == T.STRING:
            return 4 + 8 + sum(value_bytes(v, sub) for v in value)
        return 4 + 8 + sizes[sub] * len(value)
    return sizes[vtype]


def _pad(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def file_bytes(entries: list[Entry], tensors: list[tuple]) -> int:
    """The size of the GGUF file `write_file` makes of these entries and (name, array, raw type) tensors."""
    head = 4 + 4 + 8 + 8
    head += sum(8 + len(e.key.encode("utf-8")) + 4 + value_bytes(e.value, e.vtype, e.sub) for e in entries)
    head += sum(8 + len(name.encode("utf-8")) + 4 + 8 * arr.ndim + 4 + 8 for name, arr, _ in tensors)
    return _pad(head) + sum(_pad(arr.nbytes) for _, arr, _ in tensors)


def write_file(path: str | os.PathLike, arch: str, entries: list[Entry], tensors: list[tuple]) -> None:
    """Write the entries (general.architecture is the writer's own) and tensors, in order."""
    from gguf import GGUFWriter

    wr = GGUFWriter(str(path), arch)
    for e in entries:
        if e.key != "general.architecture":
            wr.add_key_value(e.key, e.value, e.vtype, sub_type=e.sub)
    for name, arr, raw in tensors:
        wr.add_tensor(name, arr, raw_dtype=raw)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
