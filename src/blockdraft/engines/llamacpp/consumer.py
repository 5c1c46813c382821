"""llama.cpp as a consumer of blockdraft's drafters (one `Engine` of blockdraft.engines): llama-server
reads the one-file GGUF `blockdraft convert --to gguf` writes (the `dflash` architecture of
`src/models/dflash.cpp`) and serves DFlash (`--spec-type draft-dflash`), DSpark (`draft-dspark`) and
DFlash2 (`draft-dflash`, told apart by its selector tensors).

`LLAMACPP_CAPTURE`: the HF architectures whose llama.cpp graph records the layer inputs DFlash reads
(`t_layer_inp`), read from llama.cpp b11434's `src/models/*.cpp` and its converter's registrations.
Running it (and comparing with blockdraft's drafter) is blockdraft.engines.llamacpp.server's.
"""

from __future__ import annotations

from ...checkpoint.formats import GGUF
from ..base import Engine

LLAMACPP_READ = "b11434"
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


ENGINE = Engine(
    name="llama.cpp", release=f"llama.cpp {LLAMACPP_READ}", formats=(GGUF,),
    kinds={kind: f"--spec-type {spec}" for kind, spec in SPEC_TYPES.items()},
    capture=llamacpp_capture, capture_rule=("its graph records the layer inputs",
                                            "its graph does not record the layer inputs"),
    capture_check="target capture (llama.cpp)", capture_refused="llama-server cannot run its DFlash drafter",
    capture_fix="serve with another engine (vLLM, SGLang, blockdraft) or a llama.cpp that adds it",
)
