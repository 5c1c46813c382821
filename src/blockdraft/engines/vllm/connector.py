"""A hidden-states connector for vLLM on a CPU (imported by vLLM only, through
`kv_transfer_config.kv_connector_module_path`).

vLLM's `ExampleHiddenStatesConnector` (the `extract_hidden_states` method's writer) copies each
finished request's captured states off the device on a CUDA stream into pinned memory, which
fails on a CPU ("pin_memory=True requires a CUDA or other accelerator backend"). This subclass
changes only that copy: the states are read out of vLLM's cache and written synchronously, so a
file is complete when `generate` returns. Everything else (which slots hold a request, what the
file holds, the lock files) is vLLM's own code. On CUDA blockdraft uses vLLM's connector itself.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector, extract_from_kv_cache)


class _Done:
    """Stands where the parent keeps a CUDA event of a finished copy: always complete."""

    @staticmethod
    def query() -> bool:
        return True


class HostHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)[None]).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device),
                                       pending.token_ids.shape[0]).to("cpu", copy=True)
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        tmp = f"{pending.filename}.tmp{os.getpid()}"
        try:
            save_file({"hidden_states": states.contiguous(), "token_ids": pending.token_ids.clone()}, tmp)
            os.replace(tmp, pending.filename)
        finally:
            fd = self._lock_fds.pop(pending.req_id, None)
            if fd is not None:
                os.close(fd)  # releases the lock a reader may wait on
        self._req_copy_events[pending.req_id] = _Done()
