"""A stand-in for vLLM in a spool's engine process (`feed.STAND_IN`), for the CPU tests: transformers runs
the target on each document alone and writes what vLLM's hidden-states connector writes, one file per
document: `hidden_states` [T, k, H] of the asked aux ids in ascending order (id k < n: the state entering
layer k, transformers' `hidden_states[k]`; id n: the last layer's output before the final norm) and
`token_ids` [T]. `STUB_FAIL_AFTER=N` makes it raise after N documents (a crashed engine);
`STUB_DELAY_S` sleeps before each batch (a slow one, or a hung one), `STUB_START_S` before it is ready
(a slow start)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from safetensors.torch import save_file


def document_states(model, last_layer, n: int, ids: list[int], aux: list[int]) -> torch.Tensor:
    """What vLLM's hidden-states connector stores for one document, from transformers' model run on it
    alone: the state entering each asked layer k < n (transformers' `hidden_states[k]`) and, for k = n,
    the last layer's output before the final norm (read by a hook on `last_layer`). [T, k, H]."""
    last = {}
    hook = last_layer.register_forward_hook(lambda m, i, o: last.update(h=o[0] if isinstance(o, tuple) else o))
    try:
        with torch.no_grad():
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    return torch.stack([hs[k][0] if k < n else last["h"][0] for k in aux], dim=1).contiguous()


class TransformersCapturer:
    def __init__(self, job: dict):
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        time.sleep(float(os.environ.get("STUB_START_S", "0")))
        self.dtype = getattr(torch, job["dtype"])
        self.model = AutoModelForCausalLM.from_pretrained(job["target"], dtype=self.dtype).eval()
        self.ids, self.dir = list(job["aux_ids"]), Path(job["tmp_dir"])
        self.n = self.model.config.num_hidden_layers
        self.done = 0
        self.job = job

    def describe(self) -> dict:
        """What vLLM's capturer says it runs, and the cores this replica was given."""
        return {"dtype": str(self.dtype).replace("torch.", ""), "quantization": None,
                "layout": {"tensor_parallel": self.job.get("tensor_parallel_size", 1),
                           "pipeline_parallel": self.job.get("pipeline_parallel_size", 1),
                           "expert_parallel": bool(self.job.get("expert_parallel"))},
                "cores": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")}

    batch_tokens = 512  # what it computes in one step (vLLM: its scheduler's max_num_batched_tokens)

    def submit(self, ids: list[int]) -> str:
        self.queue = getattr(self, "queue", [])
        self.queue.append((f"d{self.done + len(self.queue)}", ids))
        return self.queue[-1][0]

    def finished(self) -> list[tuple[str, str]]:
        """One step: the first document queued, computed (as vLLM finishes documents a step at a time)."""
        rid, ids = self.queue.pop(0)
        return [(rid, self.capture([ids])[0])]

    @torch.no_grad()
    def capture(self, documents: list[list[int]]) -> list[str]:
        time.sleep(float(os.environ.get("STUB_DELAY_S", "0")))
        paths = []
        for ids in documents:
            fail = os.environ.get("STUB_FAIL_AFTER")
            if fail is not None and self.done >= int(fail):
                raise RuntimeError("the stand-in engine was told to fail here")
            states = document_states(self.model, self.model.model.layers[-1], self.n, ids, self.ids)
            path = self.dir / f"doc-{os.getpid()}-{self.done}.safetensors"
            if self.job.get("states") == "fp8":  # what blockdraft's connector writes under --engine-states fp8
                from blockdraft.engines.vllm.states import write_states

                write_states(str(path), states, torch.tensor(ids), fp8=True)
            else:  # vLLM's own connector's file
                save_file({"hidden_states": states.contiguous(), "token_ids": torch.tensor(ids)}, str(path))
            paths.append(str(path))
            self.done += 1
        return paths
