"""The target (verifier), one module per concern, lowest first:

  classes.py which transformers class loads a target (a causal LM, or a text decoder's wrapper); TargetLoadError
  family.py  target-family quirks, measured (norm rule, embedding scale, logit transform, packing)
  tiny.py    tiny targets built in code, `random:` presets of real shapes
  layers.py  where the decoder layers and the final norm are; clause 1's "+1" (hidden_states_index)
  cache.py   the GGUF -> safetensors cache, converted once per machine
  files.py   names and paths resolved, tokenizers, TargetOptions, devices, MASK/stop tokens
  shard.py   a frozen target sharded by decoder layer over the ranks (--target-fsdp)
  load.py    loading: source resolved -> model built or loaded -> sharded
  model.py   TargetModel: feature hooks and logits (clauses 1 and 3)

The names below are the package's public ones: `from blockdraft.target import TargetModel, ...`.
"""

from ..config import default_target_layer_ids
from .classes import TargetLoadError
from .files import (EMBEDDED, SPREAD_NAMES, TargetFiles, TargetOptions, cache_dir, default_dtype, is_random,
                    load_tokenizer, pick_device, pick_mask_token, resolve_target, special_ids, spread_kwargs,
                    stop_token_ids, target_num_layers, tokenizer_hash)
from .layers import (final_norm_of, find_decoder_layers, hidden_states_index, layer_id_from_hidden_states_index,
                     text_config)
from .load import TargetSource, random_source, resolve_source
from .model import TargetModel, TargetOutput, is_recording, mask_keep_supported

__all__ = [
    "EMBEDDED", "SPREAD_NAMES", "TargetFiles", "TargetLoadError", "TargetModel", "TargetOptions", "TargetOutput",
    "TargetSource",
    "cache_dir", "default_dtype", "default_target_layer_ids", "final_norm_of", "find_decoder_layers",
    "hidden_states_index", "is_random", "is_recording", "layer_id_from_hidden_states_index", "load_tokenizer",
    "mask_keep_supported", "pick_device", "pick_mask_token", "random_source", "resolve_source", "resolve_target",
    "special_ids", "spread_kwargs", "stop_token_ids", "target_num_layers", "text_config", "tokenizer_hash",
]
