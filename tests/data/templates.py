"""Chat templates written for the tests, in the styles of four thinking, tool-calling targets, each with a
reference renderer in Python: the text it writes and the characters the target itself writes in each
assistant turn (what the loss must cover). Written here from the styles' public descriptions; none is a
copy of a model's own template.

Hugging Face renders with trim_blocks and lstrip_blocks: a newline right after a block tag is
dropped, so the templates write such newlines as {{ '\n' }}.

* "chatml-think" (Qwen3's style): <|im_start|>role ... <|im_end|>, reasoning in <think> shown only for
  turns after the last user turn, tool calls as <tool_call> JSON, tool results inside a user turn;
  thinking off opens the answer with an empty <think> block.
* "glm" (GLM-4.x's style): [gMASK]<sop>, <|role|> tags and no end-of-turn marker (the next tag ends a
  turn), <think>...</think> on the turns after the last user turn and an empty pair before, tool calls
  with <arg_key>/<arg_value> pairs, tool results under <|observation|>.
* "kimi" (Kimi-K2's style): <|im_user|>user<|im_middle|> ... <|im_end|> headers, a tool-declaration
  system turn, tool calls in a <|tool_calls_section_begin|> section, reasoning as in "glm".
* "harmony" (gpt-oss's style): several assistant messages per turn (analysis, tool calls to
  functions.*, final), earlier turns' analysis dropped; a past answer ends <|end|>, the last one and
  what the model writes <|return|>, a tool call <|call|>.

A span runs from the turn's header to the end of what the target writes: the end marker it writes
when the turn is the last one (<|return|> for a harmony answer, so a past answer's <|end|> is not the
target's), or the turn's last character where the template writes no marker.
"""

from __future__ import annotations

import json

LAST_USER = ("{%- set ns = namespace(last_user=-1) %}{%- for m in messages %}{% if m.role == 'user' %}"
             "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}")

CHATML_THINK = LAST_USER + """
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}Tools:
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}<|im_start|>user
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{% if loop.index0 > ns.last_user and m.reasoning_content %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content }}{% for c in m.tool_calls or [] %}{% set f = c.function or c %}{{ '\n' }}<tool_call>
{"name": "{{ f.name }}", "arguments": {{ f.arguments if f.arguments is string else f.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""

GLM = LAST_USER + """[gMASK]<sop>
{%- if tools %}<|system|>
# Tools
{% for t in tools %}{{ t | tojson }}
{% endfor %}{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}<|system|>
{{ m.content }}
{%- elif m.role == 'user' %}<|user|>
{{ m.content }}
{%- elif m.role == 'assistant' %}<|assistant|>
{%- if loop.index0 > ns.last_user and m.reasoning_content %}<think>{{ m.reasoning_content }}</think>
{%- else %}<think></think>{% endif %}{{ '\n' }}{{ m.content }}
{%- for c in m.tool_calls or [] %}{% set f = c.function or c %}<tool_call>{{ f.name }}
{% for k, v in f.arguments.items() %}<arg_key>{{ k }}</arg_key>
<arg_value>{{ v }}</arg_value>
{% endfor %}</tool_call>{% endfor %}
{%- elif m.role == 'tool' %}<|observation|>
<tool_response>{{ m.content }}</tool_response>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}\
<think></think>{% endif %}{% endif %}"""

KIMI = LAST_USER + """
{%- if tools %}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}<|im_system|>system<|im_middle|>{{ m.content }}<|im_end|>
{%- elif m.role == 'user' %}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>
{%- elif m.role == 'assistant' %}<|im_assistant|>assistant<|im_middle|>
{%- if loop.index0 > ns.last_user %}<think>{{ m.reasoning_content or '' }}</think>{% else %}<think></think>{% endif %}
{{- m.content }}
{%- if m.tool_calls %}<|tool_calls_section_begin|>{% for c in m.tool_calls %}<|tool_call_begin|>{{ c.id }}\
<|tool_call_argument_begin|>{{ c.function.arguments if c.function.arguments is string else c.function.arguments | tojson }}<|tool_call_end|>{% endfor %}<|tool_calls_section_end|>{% endif %}
{{- '<|im_end|>' }}
{%- elif m.role == 'tool' %}<|im_system|>tool<|im_middle|>## Return of {{ m.tool_call_id }}
{{ m.content }}<|im_end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"""

HARMONY = """{%- set ns = namespace(last_user=-1) %}{%- for m in messages %}{% if m.role == 'user' %}\
{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}<|start|>system<|message|>You are a model.\
{% if tools %} Tools: {{ tools | tojson }}{% endif %}<|end|>
{%- for m in messages %}
{%- if m.role == 'system' %}<|start|>developer<|message|>{{ m.content }}<|end|>
{%- elif m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>
{%- elif m.role == 'assistant' %}
{%- if m.reasoning_content and loop.index0 > ns.last_user %}<|start|>assistant<|channel|>analysis<|message|>\
{{ m.reasoning_content }}<|end|>{% endif %}
{%- for c in m.tool_calls or [] %}<|start|>assistant to=functions.{{ c.function.name }}<|channel|>commentary json\
<|message|>{{ c.function.arguments if c.function.arguments is string else c.function.arguments | tojson }}<|call|>{% endfor %}
{%- if m.content %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}\
{% if loop.last and not add_generation_prompt %}<|return|>{% else %}<|end|>{% endif %}{% endif %}
{%- elif m.role == 'tool' %}<|start|>functions.{{ m.name }} to=assistant<|channel|>commentary<|message|>\
{{ m.content }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""

TEMPLATES = {"chatml-think": CHATML_THINK, "glm": GLM, "kimi": KIMI, "harmony": HARMONY}


class Writer:
    """Text built piece by piece, with the spans the target writes."""

    def __init__(self):
        self.text, self.spans, self.open = "", [], None

    def put(self, s: str) -> None:
        self.text += s

    def begin(self) -> None:
        self.open = len(self.text)

    def end(self, learned: bool = True) -> None:
        """Close the turn's span; `learned` False where the history shows another text than the target wrote
        (its reasoning hidden): such a turn carries no loss."""
        if learned:
            self.spans.append((self.open, len(self.text)))


def _last_user(messages) -> int:
    return max((k for k, m in enumerate(messages) if m["role"] == "user"), default=-1)


def _fn(c):
    return c.get("function") or c


def _hidden(messages, k, lu) -> bool:
    """An earlier turn (before the last user turn) whose reasoning these templates drop from the history."""
    return k < lu and bool(messages[k].get("reasoning_content"))


def _args(a) -> str:
    return a if isinstance(a, str) else json.dumps(a, ensure_ascii=False)


def chatml_think(messages, tools=None):
    w, lu = Writer(), _last_user(messages)
    if tools:
        sys_text = messages[0]["content"] + "\n\n" if messages[0]["role"] == "system" else ""
        w.put("<|im_start|>system\n" + sys_text + "Tools:\n" + "".join(json.dumps(t, ensure_ascii=False) + "\n"
                                                                       for t in tools) + "<|im_end|>\n")
    elif messages[0]["role"] == "system":
        w.put("<|im_start|>system\n" + messages[0]["content"] + "<|im_end|>\n")
    for k, m in enumerate(messages):
        if m["role"] == "user":
            w.put("<|im_start|>user\n" + m["content"] + "<|im_end|>\n")
        elif m["role"] == "assistant":
            w.put("<|im_start|>assistant\n")
            w.begin()
            if k > lu and m.get("reasoning_content"):
                w.put("<think>\n" + m["reasoning_content"] + "\n</think>\n\n")
            w.put(m["content"])
            for c in m.get("tool_calls") or []:
                f = _fn(c)
                w.put('\n<tool_call>\n{"name": "' + f["name"] + '", "arguments": ' + _args(f["arguments"]) + "}\n</tool_call>")
            w.put("<|im_end|>")
            w.end(not _hidden(messages, k, lu))
            w.put("\n")
        elif m["role"] == "tool":
            w.put("<|im_start|>user\n<tool_response>\n" + m["content"] + "\n</tool_response><|im_end|>\n")
    return w


def glm(messages, tools=None):
    w, lu = Writer(), _last_user(messages)
    w.put("[gMASK]<sop>")
    if tools:
        w.put("<|system|>\n# Tools\n" + "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in tools))
    for k, m in enumerate(messages):
        if m["role"] in ("system", "user"):
            w.put(f"<|{m['role']}|>\n" + m["content"])
        elif m["role"] == "assistant":
            w.put("<|assistant|>")
            w.begin()
            r = m.get("reasoning_content")
            w.put(f"<think>{r}</think>" if k > lu and r else "<think></think>")
            w.put("\n" + m["content"])
            for c in m.get("tool_calls") or []:
                f = _fn(c)
                w.put("<tool_call>" + f["name"] + "\n" + "".join(f"<arg_key>{a}</arg_key>\n<arg_value>{v}</arg_value>\n"
                                                               for a, v in f["arguments"].items()) + "</tool_call>")
            w.end(not _hidden(messages, k, lu))
        elif m["role"] == "tool":
            w.put("<|observation|>\n<tool_response>" + m["content"] + "</tool_response>")
    return w


def kimi(messages, tools=None):
    w, lu = Writer(), _last_user(messages)
    if tools:
        w.put("<|im_system|>tool_declare<|im_middle|>" + json.dumps(tools, ensure_ascii=False) + "<|im_end|>")
    for k, m in enumerate(messages):
        if m["role"] == "system":
            w.put("<|im_system|>system<|im_middle|>" + m["content"] + "<|im_end|>")
        elif m["role"] == "user":
            w.put("<|im_user|>user<|im_middle|>" + m["content"] + "<|im_end|>")
        elif m["role"] == "assistant":
            w.put("<|im_assistant|>assistant<|im_middle|>")
            w.begin()
            w.put("<think>" + (m.get("reasoning_content") or "") + "</think>" if k > lu else "<think></think>")
            w.put(m["content"])
            if m.get("tool_calls"):
                w.put("<|tool_calls_section_begin|>" + "".join(
                    f"<|tool_call_begin|>{c['id']}<|tool_call_argument_begin|>{_args(c['function']['arguments'])}<|tool_call_end|>"
                    for c in m["tool_calls"]) + "<|tool_calls_section_end|>")
            w.put("<|im_end|>")
            w.end(not _hidden(messages, k, lu))
        elif m["role"] == "tool":
            w.put(f"<|im_system|>tool<|im_middle|>## Return of {m['tool_call_id']}\n" + m["content"] + "<|im_end|>")
    return w


def harmony(messages, tools=None):
    w, lu = Writer(), _last_user(messages)
    w.put("<|start|>system<|message|>You are a model." + (" Tools: " + json.dumps(tools, ensure_ascii=False) if tools else "")
          + "<|end|>")
    for k, m in enumerate(messages):
        if m["role"] == "system":
            w.put("<|start|>developer<|message|>" + m["content"] + "<|end|>")
        elif m["role"] == "user":
            w.put("<|start|>user<|message|>" + m["content"] + "<|end|>")
        elif m["role"] == "assistant":
            w.put("<|start|>assistant")
            w.begin()
            first = True
            if m.get("reasoning_content") and k > lu:
                w.put("<|channel|>analysis<|message|>" + m["reasoning_content"] + "<|end|>")
                first = False
            for c in m.get("tool_calls") or []:
                w.put(("" if first else "<|start|>assistant") + f" to=functions.{c['function']['name']}<|channel|>"
                      f"commentary json<|message|>{_args(c['function']['arguments'])}<|call|>")
                first = False
            if m["content"]:
                w.put(("" if first else "<|start|>assistant") + "<|channel|>final<|message|>" + m["content"])
                if k == len(messages) - 1:
                    w.put("<|return|>")
                    w.end(not _hidden(messages, k, lu))
                else:
                    w.end(not _hidden(messages, k, lu))  # the model writes <|return|> here; the template's <|end|> is not its own
                    w.put("<|end|>")
            else:
                w.end(not _hidden(messages, k, lu))
        elif m["role"] == "tool":
            w.put(f"<|start|>functions.{m['name']} to=assistant<|channel|>commentary<|message|>" + m["content"] + "<|end|>")
    return w


REFERENCE = {"chatml-think": chatml_think, "glm": glm, "kimi": kimi, "harmony": harmony}
