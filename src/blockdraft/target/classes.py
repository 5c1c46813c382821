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
