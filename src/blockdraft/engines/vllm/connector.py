"""The hidden-states connector blockdraft's capture engines use, on a CPU and on CUDA (imported by vLLM
only, through `kv_transfer_config.kv_connector_module_path`).

It is vLLM's `ExampleHiddenStatesConnector` (the `extract_hidden_states` method's writer) with two
changes; everything else (which slots hold a request, what the file holds, the lock files) is vLLM's
own code:

* **Where the states are.** vLLM looks for the KV-cache group whose spec is its `HiddenStateCacheSpec`
  and refuses any other layout ("the hidden-states layer must be isolated in its own group (MLA
  verifiers are unsupported)"). The spec is a subclass of MLA's, so vLLM's planner may put the
  hidden-states layer in one group with an MLA target's layers (DeepSeek-V3, Kimi-K2), where that
  search finds no group of its own. This connector finds the group by the hidden-states layer's name
  (`cache_only_layers.N`, the one layer vLLM's `ExtractHiddenStatesModel` makes) in any layout, and
  reads that layer's own block size when its group holds several specs.
* **The copy on a CPU.** vLLM copies each finished request's states on a CUDA stream into pinned
  memory, which fails on a CPU ("pin_memory=True requires a CUDA or other accelerator backend"). When
  the cache lives on the CPU the states are copied block by block straight from the cache into the
  mapped file (`states.StatesFile`: one copy), synchronously, so a file is complete when its request
  is; on CUDA vLLM's own asynchronous copy into pinned memory runs, and its writer thread then copies
  that once into the mapped file (`states.write_states`) where vLLM's would serialize it to bytes and
  write those (two copies).
"""

from __future__ import annotations

import os

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector, extract_from_kv_cache)

from .states import StatesFile, write_states

HIDDEN_LAYER = "cache_only_layers."  # the name vLLM gives the hidden-states layer (extract_hidden_states.py)


def hidden_state_group(kv_cache_config) -> tuple[int, str] | None:
    """(group index, layer name) of the group holding the hidden-states layer, found by its name; None
    when no group names it."""
    for gid, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or []):
        for name in group.layer_names:
            if HIDDEN_LAYER in name:
                return gid, name
    return None


class _Done:
    """Stands where the parent keeps a CUDA event of a finished copy: always complete."""

    @staticmethod
    def query() -> bool:
        return True


class BlockdraftHiddenStatesConnector(ExampleHiddenStatesConnector):
    @classmethod
    def _find_cache_kv_group_id(cls, kv_cache_config) -> int:
        found = hidden_state_group(kv_cache_config)
        return found[0] if found is not None else super()._find_cache_kv_group_id(kv_cache_config)

    @staticmethod
    def _get_cache_block_size(vllm_config, kv_cache_config, cache_kv_group_id: int) -> int:
        found = hidden_state_group(kv_cache_config)
        if found is not None and found[0] == cache_kv_group_id:
            spec = kv_cache_config.kv_cache_groups[cache_kv_group_id].kv_cache_spec
            own = getattr(spec, "kv_cache_specs", None)  # a group of several specs: the layer's own
            if isinstance(own, dict) and found[1] in own:
                return own[found[1]].block_size
            return spec.block_size
        return ExampleHiddenStatesConnector._get_cache_block_size(vllm_config, kv_cache_config, cache_kv_group_id)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # `--engine-states fp8`: fp8 with a scale per token (states.quantize), half of bf16's bytes
        self._fp8 = self._kv_transfer_config.get_from_extra_config("blockdraft_states", "engine") == "fp8"

    def _write_tensors(self, tensors, event, filename: str, lock_fd) -> None:
        """vLLM's writer thread (CUDA): the pinned states copied once into the mapped file (quantized
        first under fp8)."""
        try:
            event.synchronize()
            write_states(filename, tensors["hidden_states"], tensors["token_ids"], fp8=self._fp8)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the lock a reader may wait on

    def _submit_async_write(self, pending) -> None:
        if self._kv_cache is not None and self._kv_cache.device.type != "cpu":
            return super()._submit_async_write(pending)
        if not self._is_tp_rank_zero:
            return
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        tmp = f"{pending.filename}.tmp{os.getpid()}"
        try:
            self._write_from_cache(tmp, pending)
            os.replace(tmp, pending.filename)
        finally:
            fd = self._lock_fds.pop(pending.req_id, None)
            if fd is not None:
                os.close(fd)  # releases the lock a reader may wait on
        self._req_copy_events[pending.req_id] = _Done()

    def _write_from_cache(self, path: str, pending) -> None:
        """A finished request's states, from the CPU cache into its file."""
        kv, T = self._kv_cache, int(pending.token_ids.shape[0])  # kv: [blocks, states, block size, hidden]
        if self._fp8 or kv.shape[2] != self._block_size:  # vLLM's own gather, by slot (then quantized)
            blocks = torch.tensor(pending.block_ids, dtype=torch.long)
            slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)[None]).flatten()
            write_states(path, extract_from_kv_cache(kv, slots, T), pending.token_ids, fp8=self._fp8)
            return
        f = StatesFile(path, pending.token_ids, kv.shape[1], kv.shape[-1], kv.dtype)
        try:  # each block's slots straight into the file: the one copy
            at = 0
            for b in pending.block_ids:
                m = min(self._block_size, T - at)
                if m <= 0:
                    break
                f.states[at:at + m].copy_(kv[b, :, :m].transpose(0, 1))
                at += m
        finally:
            f.close()

