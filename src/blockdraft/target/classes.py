"""Which transformers class loads a target from its config, and the one error every loading path
raises when the target does not load.

A target is a causal LM: AutoModelForCausalLM where transformers maps the config's type there.
Some families ship only as a wrapper around a text decoder (transformers 5.25: GLM-5-Next,
Mistral-Large-4 and Kimi-K2.5 as ForConditionalGeneration, Mistral-4's causal LM mapped only under
image-text-to-text); blockdraft then loads the class AutoModelForImageTextToText names and trains a
drafter for its text decoder, as vLLM serves one: the states of the text model's decoder layers and
the wrapper's own logits on text-only input (tests/target/test_wrappers.py).

Imports nothing of blockdraft.
"""

from __future__ import annotations


class TargetLoadError(ValueError):
    """The target's model could not be built or read (its config, class or weights): the step that
    failed is loading, not anything blockdraft checks after it. The message names the target and the
    cause; the transformers exception is chained."""


def auto_class(config, name=None):
    """The transformers auto class whose mapping holds `config`'s type: AutoModelForCausalLM first,
    else AutoModelForImageTextToText (a wrapper whose text-only forward is a causal LM's); a
    TargetLoadError naming the target `name` and the type where neither holds it."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
        if type(config) in auto._model_mapping:
            return auto
    kind = getattr(config, "model_type", None) or type(config).__name__
    raise TargetLoadError(f"the target {name or kind} failed to load: transformers maps model type {kind!r} "
                          f"({type(config).__name__}) to no causal LM or image-text-to-text class")


def failed(name, e: BaseException) -> TargetLoadError:
    """The TargetLoadError for target `name` whose loading raised `e` (raise it `from e`)."""
    cause = " ".join(str(e).split())
    return TargetLoadError(f"the target {name} failed to load: {type(e).__name__}: {cause}")


def read_config(local, name=None):
    """The transformers config of the target directory `local`, or a TargetLoadError naming `name`
    (default: `local`) with the cause."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(local)
    except Exception as e:  # an unknown model type, a broken config.json: the target does not load
        raise failed(local if name is None else name, e) from e


def stored_keys(local, model) -> dict[str, str]:
    """{name in `model` (the target of directory `local`, on any device): its key in the safetensors files},
    read through transformers' own renaming of stored keys (a wrapper's checkpoint may keep another layout:
    Mistral-Large-4's `tok_embeddings.weight`, Kimi-K2.5's `language_model.model.*`). Keys that a converter
    reshapes (fused experts) are left out: only plain renames map one stored tensor onto one parameter."""
    from pathlib import Path

    from safetensors import safe_open

    keys = [k for f in sorted(Path(local).glob("*.safetensors")) for k in safe_open(str(f), "pt").keys()]
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # a transformers without key conversions stores the module names
        return {k: k for k in keys}
    conversions = get_model_conversion_mapping(model)
    renames = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    meta = {n: None for n in model.state_dict()}
    out = {}
    for key in keys:
        name, converter = rename_source_key(key, renames, converters, model.base_model_prefix, meta)
        if converter is None:
            out.setdefault(name, key)
    return out


def head_keys(local) -> list[str]:
    """The safetensors keys of the head's weight and of the input embedding's (a tied head is stored as
    the embedding) of the target in directory `local`, those stored, in that order."""
    import torch

    config = read_config(local)
    with torch.device("meta"):
        model = auto_class(config, local).from_config(config)
    stored = stored_keys(local, model)
    params = list(model.named_parameters(remove_duplicate=False))  # a tied tensor under each of its names
    wanted = [model.get_output_embeddings().weight, model.get_input_embeddings().weight]
    return [stored[n] for w in wanted for n, p in params if p is w and n in stored]
