"""vLLM's own tool-call and reasoning parsers on a regenerated turn, called as `vllm serve`'s chat path
calls them on a finished answer: the reasoning parser first (`extract_reasoning`: reasoning, content),
then the tool parser on what is left (`extract_tool_calls`). The parsers are looked up by the names
`vllm serve --tool-call-parser / --reasoning-parser` take, in vLLM's registries. vLLM is imported only
here, only when a parser is asked for; either engine can use them.
"""

from __future__ import annotations


class ServerParser:
    """The parsers named, checked at once; `bind(tokenizer)` gives `parse(text, tools) -> message`."""

    def __init__(self, tool_parser: str | None, reasoning_parser: str | None):
        from .job import require_vllm

        try:
            require_vllm()
        except ValueError as e:
            raise ValueError(f"--tool-call-parser / --reasoning-parser use vLLM's own parsers: {e}") from None
        from vllm.reasoning import ReasoningParserManager
        from vllm.tool_parsers import ToolParserManager

        self.tool_cls = _lookup(ToolParserManager, "get_tool_parser", tool_parser, "--tool-call-parser")
        self.reasoning_cls = _lookup(ReasoningParserManager, "get_reasoning_parser", reasoning_parser,
                                     "--reasoning-parser")
        self.names = tool_parser, reasoning_parser

    def bind(self, tokenizer):
        reasoning = None
        if self.reasoning_cls is not None:
            try:
                reasoning = self.reasoning_cls(tokenizer)
            except Exception as e:  # a parser whose markers the tokenizer lacks refuses in its constructor
                raise ValueError(f"--reasoning-parser {self.names[1]} does not fit this target's tokenizer: "
                                 f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None

        def parse(text: str, tools) -> dict:
            return self.parse(tokenizer, reasoning, text, tools)

        return parse

    def parse(self, tokenizer, reasoning, text: str, tools) -> dict:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest(model="target", messages=[{"role": "user", "content": ""}],
                                        tools=tools or None)
        thought, content = (None, text) if reasoning is None else reasoning.extract_reasoning(text, request)
        message = {"role": "assistant", "content": (content or "").strip()}
        if thought is not None:
            message["reasoning_content"] = thought.strip()
        if self.tool_cls is not None:
            info = self.tool_cls(tokenizer, request.tools).extract_tool_calls(content or "", request)
            calls = []
            if info.tools_called:
                message["content"] = (info.content or "").strip()
                calls = [{"id": c.id, "type": "function",
                          "function": {"name": c.function.name, "arguments": c.function.arguments}}
                         for c in info.tool_calls]
            message["tool_calls"] = calls  # [] where the target called nothing: compared with the data's
        return message


def _lookup(manager, getter: str, name: str | None, flag: str):
    if not name:
        return None
    try:
        return getattr(manager, getter)(name)
    except KeyError:
        names = ", ".join(sorted(manager.list_registered()))
        raise ValueError(f"{flag} {name}: vLLM has no such parser; it has: {names}") from None


def server_parser(tool_parser: str | None = None, reasoning_parser: str | None = None) -> ServerParser:
    return ServerParser(tool_parser, reasoning_parser)

