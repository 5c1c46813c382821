"""One document's captured states as a file that costs one host copy on each side: the engine's connector
gathers the states straight into the mapped file, and the reader maps it and copies the states once, into
the rows it assembles. The file is a safetensors file (`token_ids` [T] int64, then `hidden_states`
[T, k, H] in the capture's dtype: the states start 8-byte aligned and the data has no holes), the tensors
vLLM's own hidden-states connector writes, so safetensors' own reader loads it too.

Nothing here imports vLLM: the engine's process and the readers' both use it.
"""

from __future__ import annotations

import json
import mmap
import os

import torch

NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
         torch.float8_e4m3fn: "F8_E4M3"}
DTYPES = {v: k for k, v in NAMES.items()}
FP8 = torch.float8_e4m3fn
# a Mooncake manifest's metadata (mooncake_connector.py writes it, remote.py checks it): the hidden_states
# indices the server captures, in order
AUX_KEY = "blockdraft_aux_ids"
SCALES = "hidden_states_scales"  # fp8 states' per-token scales, named as hs-connectors' FP8 connector names them


def quantize(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, k, H] states as fp8 (e4m3) and one float32 scale per token over all of its k x H values
    ([T, 1, 1]: the token's largest magnitude maps to fp8's largest), the layout hs-connectors' FP8
    backend stores."""
    x = states.float()
    scale = (x.abs().amax(dim=(1, 2), keepdim=True) / torch.finfo(FP8).max).clamp(min=1e-12)
    return (x / scale).to(FP8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


def _header(entries: list[tuple[str, torch.dtype, tuple]]) -> tuple[bytes, list[int]]:
    """The safetensors header of tensors laid out one after another, and each one's byte offset from the
    start of the file (the header is padded to 8 bytes, as safetensors' own writer pads it)."""
    meta, offsets, at = {}, [], 0
    for name, dtype, shape in entries:
        size = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        meta[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [at, at + size]}
        offsets.append(at)
        at += size
    head = json.dumps(meta, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    start = 8 + len(head)
    return len(head).to_bytes(8, "little") + head, [start + o for o in offsets]


class StatesFile:
    """A states file being written: `states` is a [T, k, H] tensor over the mapped file (fill it, then
    `close`); the token ids are written at once."""

    def __init__(self, path: str, token_ids: torch.Tensor, n_states: int, hidden: int, dtype: torch.dtype,
                 scales: torch.Tensor | None = None):
        T = int(token_ids.shape[0])
        entries = [("token_ids", torch.int64, (T,))] + ([(SCALES, torch.float32, (T, 1, 1))] if scales is not None
                                                        else [])
        head, offsets = _header(entries + [("hidden_states", dtype, (T, n_states, hidden))])
        at_states = offsets[-1]
        size = at_states + T * n_states * hidden * torch.empty(0, dtype=dtype).element_size()
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(self.fd, max(size, 1))
            os.pwrite(self.fd, head, 0)
            os.pwrite(self.fd, token_ids.to(torch.int64).contiguous().numpy().tobytes(), offsets[0])
            if scales is not None:
                os.pwrite(self.fd, scales.float().contiguous().numpy().tobytes(), offsets[1])
            self.map = mmap.mmap(self.fd, max(size, 1))
        except BaseException:
            os.close(self.fd)
            raise
        count = T * n_states * hidden
        self.states = torch.frombuffer(self.map, dtype=dtype, count=count, offset=at_states).view(T, n_states, hidden)

    def close(self) -> None:
        del self.states
        self.map.close()
        os.close(self.fd)


def write_states(path: str, states: torch.Tensor, token_ids: torch.Tensor, fp8: bool = False) -> None:
    """A whole [T, k, H] tensor written as a states file (one copy: into the mapped file); `fp8`: as fp8
    with per-token scales (`quantize`)."""
    scales = None
    if fp8:
        states, scales = quantize(states)
    f = StatesFile(path, token_ids, states.shape[1], states.shape[2], states.dtype, scales=scales)
    try:
        f.states.copy_(states)
    finally:
        f.close()


def read_states(path: str) -> dict[str, torch.Tensor]:
    """The tensors of a states file (or any safetensors file of these dtypes) as views of the mapped file:
    no copy is made until the caller copies what it needs. The file may be deleted while they live."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        meta = json.loads(fh.read(n))
        m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)  # private: writable views, never written back
    out = {}
    for name, e in meta.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES[e["dtype"]]
        a, b = e["data_offsets"]
        count = (b - a) // torch.empty(0, dtype=dtype).element_size()
        out[name] = torch.frombuffer(m, dtype=dtype, count=count, offset=8 + n + a).view(e["shape"]) if count else \
            torch.empty(e["shape"], dtype=dtype)
    return out
