"""Training data: conversations in, packed token rows with assistant-only loss masks out.

    conversations, stats = load_conversations("chats.jsonl")   # OpenAI or ShareGPT schema
    example = render(tokenizer, conversations[0])              # {"input_ids", "loss_mask"}
    rows = pack([example, ...], max_length=2048, pad_token_id=tokenizer.pad_token_id)
    rows = build_rows(tokenizer, "chats.jsonl", 2048)           # all three steps

`rows` holds LongTensors [R, max_length] named like the fields of
`blockdraft.train.step.Batch`: ``Batch(**rows)``.
"""

from .chat import assistant_spans, render, render_text
from .packing import PackStats, pack
from .pipeline import build_rows
from .sources import ROLES, LoadStats, load_conversations, parse_record

__all__ = [
    "LoadStats",
    "PackStats",
    "ROLES",
    "assistant_spans",
    "build_rows",
    "load_conversations",
    "pack",
    "parse_record",
    "render",
    "render_text",
]
