"""The hidden-states connector of an engine on another node: each finished request's states go into a
Mooncake store, and its manifest (where they are, their shapes) back to the trainer in vLLM's response
(imported by vLLM only, through `kv_transfer_config.kv_connector_module_path`).

It is hs-connectors' `MooncakeHiddenStatesConnector` (speculators' transport: its store, its packed
layout, its versioned manifest and its error markers), so the trainer reads what a server set up for
speculators' Mooncake backend writes. Three changes:

* **Where the states are**, as in `connector.py`: the hidden-states layer's group is found by the
  layer's name, so MLA targets (DeepSeek-V3, Kimi-K2) and blockdraft's plugin classes (GLM-4.x MoE)
  capture too, where hs-connectors refuses them.
* **A CPU engine.** hs-connectors copies on an accelerator stream; on a CPU the worker thread copies
  from the cache directly (the request's blocks stay held until the copy is done, as on a GPU).
* **The layers named.** The manifest's metadata carries the target layers captured (`aux_ids`), so a
  trainer refuses in one line an engine started for other layers, whose states would have the same
  shapes and a different meaning.
"""

from __future__ import annotations

import contextlib

from hs_connectors.mooncake_hidden_states_connector import MooncakeHiddenStatesConnector

from .connector import BlockdraftHiddenStatesConnector, hidden_state_group
from .states import AUX_KEY


class _HostDevice:
    """The stream API hs-connectors uses, for a cache that lives in host memory (nothing to order)."""

    class Stream:
        def wait_event(self, event) -> None:
            pass

    class Event:
        def record(self) -> None:
            pass

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()


class BlockdraftMooncakeConnector(MooncakeHiddenStatesConnector):
    @classmethod
    def _find_cache_kv_group_id(cls, kv_cache_config) -> int:
        found = hidden_state_group(kv_cache_config)
        return found[0] if found is not None else super()._find_cache_kv_group_id(kv_cache_config)

    # the layer's own block size where its group holds several specs (connector.py)
    _get_cache_block_size = staticmethod(BlockdraftHiddenStatesConnector._get_cache_block_size)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        hf = self._vllm_config.speculative_config.draft_model_config.hf_config
        self._aux_ids = [int(i) for i in getattr(hf, "eagle_aux_hidden_state_layer_ids", None) or []]

    def _ensure_store(self) -> None:
        """The store client, its puts placed in this node's own segment (`remote.LocalPuts`)."""
        from .remote import local_puts

        super()._ensure_store()
        local_puts(self._store)

    def _device(self):
        if self._kv_cache is not None and self._kv_cache.device.type == "cpu":
            return _HostDevice
        return super()._device()

    def request_finished(self, request, block_ids):
        delay, manifest = super().request_finished(request, block_ids)
        if manifest is not None:  # the pending save holds this same dict
            manifest["metadata"][AUX_KEY] = self._aux_ids
        return delay, manifest

