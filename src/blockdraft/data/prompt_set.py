"""The bundled prompt set: user turns the target wrote itself (Magpie) plus prompts built from the
Python standard library and manual pages of the machine that built it, committed as data so that
`blockdraft regenerate` answers the same prompts on every host.

    blockdraft prompts --out src/blockdraft/assets/data/prompts.jsonl.gz --magpie 7600 --oversample 1.0 \\
        --builtin 4500 --engine vllm

(the committed set was sampled in three restarts, each continuing at seed + samples so far; the
host's stdlib and man pages gave about 3,000 distinct built-in prompts of the 4,500 asked).

Records: {"id": "magpie-000017", "kind": "magpie" | "func" | "explain" | "prose" | "man" | "arith",
"messages": [{"role": "user", "content": ...}]}. No evaluation prompt (MT-Bench, GSM8K,
HumanEval) is in it, nor any text sharing a word 8-gram with one.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

DEFAULT_PROMPTS = Path(__file__).resolve().parent.parent / "assets" / "data" / "prompts.jsonl.gz"


def token_bytes(tokenizer) -> float:
    """The bytes per token an answer not yet written is given: twice the mean a token of this
    vocabulary takes in a JSON string (decoded, escaped). Text averages below the mean (long tokens
    are rare); even a random model's uniform picks stay under twice it."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return 2 * sum(len(json.dumps(t, ensure_ascii=False).encode()) - 2 for t in texts) / max(1, len(texts))


def read_prompts(path: str | os.PathLike = DEFAULT_PROMPTS) -> list[tuple[str, list[dict]]]:
    """(id, messages) of a prompt file (JSONL, gzip if it ends .gz)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no such prompt file; build one with `blockdraft prompts --out {path}`")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            recs = [json.loads(line) for line in f if line.strip()]
    except (OSError, EOFError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: damaged prompt file ({e}); rebuild it with `blockdraft prompts`") from None
    return [(str(r["id"]), r["messages"]) for r in recs]


def samples_path(out: str | os.PathLike) -> Path:
    """Where `blockdraft prompts --out OUT` keeps its raw Magpie samples across a restart."""
    return Path(out).with_name(Path(out).name + ".samples.jsonl")


def _first_record(path: Path) -> dict | None:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            got = json.loads(f.readline() or "null")
    except (OSError, EOFError, ValueError):
        return None
    return got if isinstance(got, dict) else None


def check_prompts_out(out: str | os.PathLike) -> None:
    """`blockdraft prompts --out`, before any sampling: a new file, or a prompt set (and its samples
    file) such as prompts writes; a user's file or a link is refused naming it."""
    from ..rundir.ownership import check_file

    check_file(out, "prompts", lambda p: {"id", "kind", "messages"} <= set(_first_record(p) or {}),
               "a prompt set (records of id, kind, messages)")
    check_file(samples_path(out), "prompts", lambda p: set(_first_record(p) or {"": 0}) == {"text"},
               "Magpie samples (records of text)")


def write_prompts(records: list[dict], out: str | os.PathLike) -> Path:
    """Write records atomically (gzip for .gz, with a fixed timestamp so rebuilding gives the same bytes)."""
    from ..rundir.ownership import remove_leftovers, temp_path

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(out)  # what a killed write left (never a file of another name)
    tmp = temp_path(out)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    from ..rundir.atomic import check_free_space

    check_free_space(out.parent, len(text), f"the {len(records)} records")  # gzip writes fewer: a bound
    if out.suffix == ".gz":
        with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
            f.write(text)
    else:
        tmp.write_bytes(text)
    os.replace(tmp, out)
    return out


def magpie_samples(sampler, n: int, seed: int, samples_path: Path | None, progress: bool = True) -> list[str]:
    """`n` raw Magpie samples; with `samples_path`, each finished sample is appended there as it comes
    and a restart samples only what is missing (with the next seed, so nothing repeats). `sampler`: a
    call returning (Magpie's sampling function, the tokenizer), made once a sample is needed
    (`engines.runner(name).sampler`)."""
    from .magpie import sample_user_turns

    have: list[str] = []
    if samples_path is not None and samples_path.exists():
        raw = samples_path.read_bytes()
        cut = raw.rfind(b"\n") + 1
        if cut != len(raw):  # a torn last line from a kill
            with open(samples_path, "r+b") as f:
                f.truncate(cut)
        have = [json.loads(ln)["text"] for ln in raw[:cut].decode("utf-8").splitlines() if ln.strip()]
    if len(have) >= n:
        return have[:n]
    generate, tok = sampler()
    if samples_path is not None:  # each sample a line of at most MAX_TOKENS tokens, before the first is drawn
        from ..rundir.atomic import check_free_space
        from .magpie import MAX_TOKENS
        line = len(json.dumps({"text": ""})) + 1 + MAX_TOKENS * token_bytes(tok)
        check_free_space(samples_path.parent, int((n - len(have)) * line), f"{n - len(have)} Magpie samples")

    def save(text: str) -> None:
        if samples_path is not None:
            from ..rundir.ownership import open_private

            with open_private(samples_path, "a") as f:  # never through a link
                f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")

    more = sample_user_turns(generate, tok, n - len(have), seed=seed + len(have), keep=save, progress=progress)
    return have + more


def build_prompt_set(sampler, n_magpie: int, n_builtin: int, *, seed: int = 0, oversample: float = 1.25,
                     samples_path: Path | None = None) -> list[dict]:
    """Magpie prompts sampled from the target (drawing `oversample` x as many, as filtering drops
    some) and built-in ones, filtered against the evaluation sets and deduplicated together."""
    from .default_prompts import build_prompts
    from .magpie import evaluation_texts, filter_prompts

    exclude = evaluation_texts()
    records = []
    if n_magpie:
        raw = magpie_samples(sampler, int(n_magpie * oversample), seed, samples_path)
        kept = filter_prompts(raw, exclude, n_magpie)
        records += [{"id": f"magpie-{i:06d}", "kind": "magpie", "messages": [{"role": "user", "content": t}]}
                    for i, t in enumerate(kept)]
    if n_builtin:
        built = build_prompts(n_builtin, seed=seed)
        texts = {p["messages"][0]["content"].strip(): p["kind"] for p in built}  # as filter_prompts returns them
        kept = filter_prompts(list(texts), exclude + [r["messages"][0]["content"] for r in records],
                              check=lambda t: bool(t))  # code and man pages: no English-prose test
        records += [{"id": f"builtin-{i:06d}", "kind": texts[t], "messages": [{"role": "user", "content": t}]}
                    for i, t in enumerate(kept)]
    return records
