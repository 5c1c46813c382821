"""llama.cpp as a consumer of blockdraft's drafters (one `Consumer` of blockdraft.engines): llama-server
reads the one-file GGUF `blockdraft convert --to gguf` writes (the `dflash` architecture of
`src/models/dflash.cpp`) and serves DFlash (`--spec-type draft-dflash`), DSpark (`draft-dspark`) and
DFlash2 (`draft-dflash`, told apart by its selector tensors).

`LLAMACPP_CAPTURE`: the HF architectures whose llama.cpp graph records the layer inputs DFlash reads
(`t_layer_inp`), read from llama.cpp LLAMACPP_READ's `src/models/*.cpp` and its converter's registrations.
Running it (and comparing with blockdraft's drafter) is blockdraft.engines.llamacpp.server's.
"""

from __future__ import annotations

from ...checkpoint.formats import GGUF
from ...checkpoint.formats.gguf import ACTIVATIONS
from ...config import FULL, WINDOW_ANCHOR, DrafterConfig
from ...releases import LLAMACPP_RELEASE
from ..base import ANCHOR_RULE_SERVED, Difference, Consumer

LLAMACPP_READ = LLAMACPP_RELEASE
LLAMACPP_CAPTURE = frozenset((
    "BailingMoeV3ForCausalLM", "BailingMoeV3VLForConditionalGeneration", "DeepseekV4ForCausalLM",
    "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration",
    "GptOssForCausalLM", "HunYuanDenseV1ForCausalLM", "HunYuanVLForConditionalGeneration", "IQuestCoderForCausalLM",
    "InternLM3ForCausalLM", "LFM2ForCausalLM", "LLaMAForCausalLM", "Lfm2ForCausalLM", "LlamaForCausalLM",
    "LlavaForConditionalGeneration", "MiMoV2FlashForCausalLM", "MiMoV2ForCausalLM", "MiniMaxM1ForCausalLM",
    "MiniMaxM2ForCausalLM", "MiniMaxText01ForCausalLM", "MistralForCausalLM", "MixtralForCausalLM",
    "NanbeigeForCausalLM", "NemotronHForCausalLM", "NemotronHPuzzleForCausalLM", "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration", "Qwen4ExpForCausalLM",
    "Qwen4ExpForConditionalGeneration", "VLlama3ForCausalLM",
))
# How llama-server is told each kind (common/speculative.cpp:72-84; DFlash2 has no entry of its own and
# is told apart by its selector_top_k, :1054-1055)
SPEC_TYPES = {"dflash": "draft-dflash", "dspark": "draft-dspark", "dflash2": "draft-dflash"}
# The kinds whose drafts llama-server does not log (DFlash2's selector walk writes no draft candidates,
# common/speculative.cpp:1296-1323): they are read from the target's verify batches instead
DRAFTS_FROM_BATCHES = frozenset({"dflash2"})


def llamacpp_capture() -> tuple[frozenset[str], str]:
    return LLAMACPP_CAPTURE, f"llama.cpp {LLAMACPP_READ}'s source"


def quirks(fmt: str, cfg: DrafterConfig) -> list[Difference]:
    """Where llama.cpp (LLAMACPP_READ) computes another function from the GGUF (all refusals); for the
    speculators layout, what its converter reads instead."""
    if fmt == "speculators" and cfg.kind == "dflash2":
        return [Difference("llama.cpp", False, "its converter reads DFlash2's convolution and selector fields "
                                               "only from a z-lab config's dflash_config (conversion/qwen.py): "
                                               "convert --to zlab for that converter")]
    if fmt == GGUF and cfg.kind == "lilicorr":
        return [Difference("llama.cpp", False, f"has no LiLiCorr ({LLAMACPP_READ}): the GGUF export is refused")]
    return gguf_refusals(cfg) if fmt == GGUF else []


def gguf_refusals(cfg: DrafterConfig) -> list[Difference]:
    out = []
    if cfg.kind == "domino":  # the GGUF writer refuses it first (checkpoint/formats/gguf.py)
        return [Difference("llama.cpp", False, f"llama.cpp {LLAMACPP_READ} has no Domino drafter (no GRU correction "
                                               "in its DFlash graph): the export is refused")]

    def refuse(what: str) -> None:
        out.append(Difference("llama.cpp", True, what))

    if cfg.attention_bias:
        refuse("loads no attention biases (this drafter has q/k/v/o biases)")
    if cfg.kind == "dflash2":  # dflash.cpp load_arch_tensors throws on these (lines 145-150)
        H, g, K = cfg.hidden_size, cfg.conv_group_size, cfg.selector_top_k
        if H % g:
            refuse(f"needs the hidden size divisible by conv_group_size (this DFlash2 drafter: {H} and {g})")
        if H < K * (K + 1):
            refuse(f"packs each slot's {K} candidates and {K}x{K} selector scores into one hidden-wide row: "
                   f"hidden size {H} < K(K+1) = {K * (K + 1)} (lower selector_top_k)")
    if cfg.hidden_act not in ACTIVATIONS:
        refuse(f"runs the FFN with silu or gelu only, not {cfg.hidden_act}")
    if cfg.has_sliding:
        if cfg.sliding_window_rule == WINDOW_ANCHOR:
            refuse(ANCHOR_RULE_SERVED)
        if FULL in set(cfg.layer_types) and cfg.sliding_causal_in_block:
            refuse("sets one causality flag for all draft layers; this drafter has causal sliding and "
                   "bidirectional full layers")
        if not cfg.sliding_causal_in_block and cfg.sliding_window < cfg.block_size:
            refuse(f"never masks block slots after the query, but this drafter's bidirectional "
                   f"{cfg.sliding_window}-token window is narrower than its {cfg.block_size}-token block")
    return out


CONSUMER = Consumer(
    name="llama.cpp", release=f"llama.cpp {LLAMACPP_READ}", formats=(GGUF,),
    kinds={kind: f"--spec-type {spec}" for kind, spec in SPEC_TYPES.items()},
    refused_kinds={"lilicorr": "no LiLiCorr", "domino": "no Domino drafter in its DFlash graph"},
    capture=llamacpp_capture, capture_rule=("its graph records the layer inputs",
                                            "its graph does not record the layer inputs"),
    capture_check="target capture (llama.cpp)", capture_refused="llama-server cannot run its DFlash drafter",
    capture_fix="serve with another engine (vLLM, SGLang, blockdraft) or a llama.cpp that adds it",
    quirks=quirks,
)
