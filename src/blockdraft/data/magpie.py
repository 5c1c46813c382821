"""Prompts without a dataset: the target writes user turns itself (the Magpie method, arXiv 2406.08464).

The chat template rendered up to the start of a user turn's content (system prompt and user
header included) is a prefix from which an aligned model continues with a plausible user
request; sampled until its end-of-turn marker, it gives a prompt in the target's own
distribution. Samples are cleaned, filtered (length, English text, no template markers, no
degenerate repetition) and deduplicated, and any that shares a word 8-gram with an
evaluation set (MT-Bench, GSM8K, HumanEval) is dropped, so evaluation stays unseen.
"""

from __future__ import annotations

import re

MARK = "\u2063blockdraft-user-turn\u2063"
COMMON = set("""the a an and or of to in on for with is are be can how what why when which who do does i you your
my me it this that these those please write explain give make create list describe tell about from as by at
if should would could between using use want need help find show step steps example examples code function""".split())


def user_prefix(tokenizer) -> str:
    """The template's text in front of a user turn's content (for ChatML with a default system prompt:
    `<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n`)."""
    from .chat import has_chat_template, render_text

    if not has_chat_template(tokenizer):
        raise ValueError("Magpie prompts need a chat template on the target's tokenizer")
    text = render_text(tokenizer, [{"role": "user", "content": MARK}])  # --chat-template's, where given
    if MARK not in text:
        raise ValueError("the chat template does not place the user's text where it can be found")
    return text[: text.index(MARK)]


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def ngrams(text: str, n: int = 8) -> set:
    w = _words(text)
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def normalized(text: str) -> str:
    return " ".join(_words(text))


def keep(text: str, *, min_chars: int = 16, max_chars: int = 1200) -> bool:
    """A usable English request: long enough, not too long, mostly English words, no template
    tokens, not a loop of the same words."""
    if not min_chars <= len(text) <= max_chars or "<|" in text or "|>" in text:
        return False
    letters = [c for c in text if c.isalpha()]
    if not letters or sum(c.isascii() for c in letters) / len(letters) < 0.95:
        return False
    words = _words(text)
    if len(words) < 4 or len(set(words)) / len(words) < 0.35:
        return False
    return sum(w in COMMON for w in words) / len(words) >= 0.12


def filter_prompts(texts: list[str], exclude: list[str], n: int | None = None, check=keep) -> list[str]:
    """Cleaned, deduplicated texts passing `check` (first occurrence wins) that share no word 8-gram
    with any text of `exclude` (the evaluation prompts); at most `n`."""
    banned = set().union(*(ngrams(t) for t in exclude)) if exclude else set()
    seen_full, seen_head, out = set(), set(), []
    for raw in texts:
        text = raw.strip()
        if not check(text):
            continue
        norm = normalized(text)
        head = norm[:60]
        if norm in seen_full or head in seen_head or ngrams(text) & banned:
            continue
        seen_full.add(norm)
        seen_head.add(head)
        out.append(text)
        if n is not None and len(out) >= n:
            break
    return out


def evaluation_texts() -> list[str]:
    """Every prompt of the evaluation sets (the packages named in the README's install)."""
    from .eval_prompts import SETS, load_prompt_set

    return [m["content"] for name in SETS for p in load_prompt_set(name) for m in p]


MAX_TOKENS = 160  # the longest user turn sampled, in tokens


def sample_user_turns(generate, tokenizer, n: int, *, max_tokens: int = MAX_TOKENS, temperature: float = 1.0,
                      top_p: float = 0.98, seed: int = 0, keep=None, progress: bool = False) -> list[str]:
    """`n` raw user turns sampled from the template's user prefix. `generate(prompt_ids, n, max_tokens,
    temperature, top_p, seed)` yields (ids, finished) per sample; unfinished ones are dropped.
    `keep(text)`, if given, sees every finished sample as it comes (to save them as they come)."""
    from tqdm.auto import tqdm

    prefix = tokenizer(user_prefix(tokenizer), add_special_tokens=False)["input_ids"]
    out = []
    for ids, finished in tqdm(generate(prefix, n, max_tokens, temperature, top_p, seed), total=n,
                              desc="magpie samples", disable=not progress):
        if finished:
            text = tokenizer.decode(ids, skip_special_tokens=True)
            out.append(text)
            if keep is not None:
                keep(text)
    return out
