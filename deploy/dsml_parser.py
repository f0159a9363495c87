"""DeepSeek-V3.2's answers -> OpenAI message parts: reasoning, content and DSML tool calls.

An answer in thinking mode is `{reasoning}</think>{content}`; in either mode the content may end
in a DSML block (the format `deploy.chat_dsv32` renders, parsed back):

    \\n\\n<｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

`DSMLParser` is incremental: `feed(text)` takes each new piece of decoded text and returns what
became certain (text that could still be the start of a marker is held back), `finish()` returns
the rest. Invariant: however the text is split into pieces, the merged deltas are the same,
so a streamed answer equals the non-streamed one. Tool calls stream as OpenAI streams them: the
call's id and name first, then argument fragments as they arrive (string values character by
character, other values when their parameter closes), joined into one JSON object whose string
values are the DSML text and whose other values are typed by the tool's JSON schema.
Text inside a DSML block that is not a tag (the newlines between tags) is dropped.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from deploy.chat_dsv32 import (
    DSML,
    FUNCTION_CALLS_END,
    FUNCTION_CALLS_START,
    INVOKE_END,
    PARAMETER_END,
    THINK_END,
    THINK_START,
)

CALLS_OPENER = "\n\n" + FUNCTION_CALLS_START  # the encoder's blank line belongs to the block
INVOKE_TAG = re.compile(rf'<{DSML}invoke\s+name="([^"]*)"\s*>')
PARAMETER_TAG = re.compile(rf'<{DSML}parameter\s+name="([^"]*)"\s+string="(true|false)"\s*>')
INVOKE_OPEN = f"<{DSML}invoke"
PARAMETER_OPEN = f"<{DSML}parameter"


@dataclasses.dataclass
class ToolCallDelta:
    """A piece of tool call `index`: `id` and `name` come once, first; `arguments` is a
    fragment of the JSON arguments string."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclasses.dataclass
class ParsedDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def add_tool_call(self, piece: ToolCallDelta) -> None:
        """Append `piece`, joined to the last piece when it continues the same call (so a delta
        has one piece per call, as OpenAI's stream chunks do)."""
        last = self.tool_calls[-1] if self.tool_calls else None
        if last is not None and last.index == piece.index and piece.id is None:
            last.arguments += piece.arguments
        else:
            self.tool_calls.append(dataclasses.replace(piece))

    def extend(self, other: ParsedDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        for piece in other.tool_calls:
            self.add_tool_call(piece)


@dataclasses.dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object


def merged_tool_calls(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    calls: dict[int, ToolCall] = {}
    for piece in deltas:
        if piece.index not in calls:
            calls[piece.index] = ToolCall(piece.id or "", piece.name or "", "")
        calls[piece.index].arguments += piece.arguments
    return [calls[i] for i in sorted(calls)]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest proper prefix of `marker` that `text` ends with."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


def _escape(text: str) -> str:
    """JSON string escaping of a fragment (escaping is per character, so fragments concatenate)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def schema_types(schema: dict[str, Any] | None) -> set[str]:
    """The JSON types a parameter's schema allows ({} when it says nothing)."""
    if not isinstance(schema, dict):
        return set()
    declared = schema.get("type")
    types = set([declared] if isinstance(declared, str) else declared or [])
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or []:
            types |= schema_types(option)
    if "enum" in schema and not types:
        types |= {_json_type(v) for v in schema["enum"]}
    return types


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def typed_value(raw: str, types: set[str]) -> Any:
    """A `string="false"` parameter's value: its JSON, typed by the schema where they differ
    (a schema string keeps the text as written; an integral number for "integer" becomes an int;
    text that is no JSON stays text)."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return raw
    kind = _json_type(value)
    if not types or kind in types or (kind == "integer" and "number" in types):
        return value
    if "string" in types:
        return raw
    if kind == "number" and "integer" in types and float(value).is_integer():
        return int(value)
    return value


class DSMLParser:
    """Incremental parser of one answer. `thinking`: the prompt ended in `<think>`, so the answer
    starts with reasoning; `parse_tools`: DSML blocks become tool calls (else content);
    `tools`: the request's OpenAI tools, for the parameters' schemas."""

    def __init__(
        self, thinking: bool, parse_tools: bool, tools: list[dict[str, Any]] | None = None
    ):
        self._state = "reasoning" if thinking else "content"
        self._at_start = True  # reasoning may repeat the prompt's `<think>`; drop it
        self._parse_tools = parse_tools
        self._schemas = {}
        for tool in tools or []:
            function = tool.get("function", tool)
            self._schemas[function.get("name")] = (function.get("parameters") or {}).get(
                "properties"
            ) or {}
        self._buffer = ""
        self._num_calls = 0
        self._call_name = ""
        self._num_params = 0
        self._param_name = ""

    # -- public ---------------------------------------------------------------------------------

    @property
    def num_tool_calls(self) -> int:
        """Calls opened so far."""
        return self._num_calls

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        delta = ParsedDelta()
        while self._step(delta, final=False):
            pass
        return delta

    def finish(self) -> ParsedDelta:
        """Everything held back; open parameters and calls are closed."""
        delta = ParsedDelta()
        while self._step(delta, final=True):
            pass
        if self._state == "string_value":
            delta.add_tool_call(ToolCallDelta(self._num_calls - 1, arguments='"'))
            self._state = "invoke"
        elif self._state == "value":
            self._emit_value(delta, self._buffer)
            self._state = "invoke"
        if self._state == "invoke":
            self._close_invoke(delta)
        self._buffer = ""
        return delta

    # -- the state machine ----------------------------------------------------------------------

    def _step(self, delta: ParsedDelta, final: bool) -> bool:
        """Consume what can be decided from the buffer; True if the state changed."""
        return getattr(self, f"_step_{self._state}")(delta, final)

    def _text_until(self, marker: str, final: bool) -> tuple[str, bool]:
        """(text certainly before `marker`, whether the marker was found and consumed)."""
        index = self._buffer.find(marker)
        if index >= 0:
            text, self._buffer = self._buffer[:index], self._buffer[index + len(marker) :]
            return text, True
        keep = 0 if final else _partial_suffix(self._buffer, marker)
        text = self._buffer[: len(self._buffer) - keep]
        self._buffer = self._buffer[len(text) :]
        return text, False

    def _step_reasoning(self, delta: ParsedDelta, final: bool) -> bool:
        if self._at_start:
            if THINK_START.startswith(self._buffer) and not final:
                return False
            if self._buffer.startswith(THINK_START):
                self._buffer = self._buffer[len(THINK_START) :]
            self._at_start = False
        text, found = self._text_until(THINK_END, final)
        delta.reasoning += text
        if found:
            self._state = "content"
        return found

    def _step_content(self, delta: ParsedDelta, final: bool) -> bool:
        if not self._parse_tools:
            delta.content += self._buffer
            self._buffer = ""
            return False
        index = self._buffer.find(FUNCTION_CALLS_START)
        if index >= 0:
            text = self._buffer[:index]
            delta.content += text[:-2] if text.endswith("\n\n") else text
            self._buffer = self._buffer[index + len(FUNCTION_CALLS_START) :]
            self._state = "calls"
            return True
        # Held back: a possible start of "\n\n<｜DSML｜function_calls>" (its blank line is the
        # encoder's, not content).
        keep = 0 if final else _partial_suffix(self._buffer, CALLS_OPENER)
        delta.content += self._buffer[: len(self._buffer) - keep]
        self._buffer = self._buffer[len(self._buffer) - keep :]
        return False

    def _next_tag(self, tags: dict[str, re.Pattern | None], final: bool) -> tuple[str, Any]:
        """The earliest of `tags` (name -> regex for an opening tag with attributes, or None for
        a literal closing tag) in the buffer: (name, match or None); text before it is dropped.
        ("", None) while undecided."""
        best: tuple[int, str, Any] | None = None
        for literal, pattern in tags.items():
            if pattern is None:
                index = self._buffer.find(literal)
                match = None
            else:
                match = pattern.search(self._buffer)
                index = match.start() if match else -1
            if index >= 0 and (best is None or index < best[0]):
                best = (index, literal, match)
        if best is None:
            if not final:  # keep what might be a tag's start
                start = self._buffer.rfind("<")
                self._buffer = self._buffer[start:] if start >= 0 else ""
            return "", None
        index, literal, match = best
        end = match.end() if match else index + len(literal)
        self._buffer = self._buffer[end:]
        return literal, match

    def _step_calls(self, delta: ParsedDelta, final: bool) -> bool:
        tag, match = self._next_tag({INVOKE_OPEN: INVOKE_TAG, FUNCTION_CALLS_END: None}, final)
        if tag == FUNCTION_CALLS_END:
            self._state = "content"
            return True
        if tag == INVOKE_OPEN:
            self._call_name = match.group(1)
            self._num_params = 0
            delta.add_tool_call(
                ToolCallDelta(
                    self._num_calls, id=f"call_{uuid.uuid4().hex[:24]}", name=self._call_name
                )
            )
            self._num_calls += 1
            self._state = "invoke"
            return True
        return False

    def _step_invoke(self, delta: ParsedDelta, final: bool) -> bool:
        tag, match = self._next_tag({PARAMETER_OPEN: PARAMETER_TAG, INVOKE_END: None}, final)
        if tag == INVOKE_END:
            self._close_invoke(delta)
            self._state = "calls"
            return True
        if tag == PARAMETER_OPEN:
            self._param_name, is_str = match.group(1), match.group(2) == "true"
            prefix = "{" if self._num_params == 0 else ", "
            self._num_params += 1
            arguments = prefix + json.dumps(self._param_name, ensure_ascii=False) + ": "
            if is_str:
                arguments += '"'
            delta.add_tool_call(ToolCallDelta(self._num_calls - 1, arguments=arguments))
            self._state = "string_value" if is_str else "value"
            return True
        return False

    def _step_string_value(self, delta: ParsedDelta, final: bool) -> bool:
        text, found = self._text_until(PARAMETER_END, final)
        fragment = _escape(text) + ('"' if found else "")
        if fragment:
            delta.add_tool_call(ToolCallDelta(self._num_calls - 1, arguments=fragment))
        if found:
            self._state = "invoke"
        return found

    def _step_value(self, delta: ParsedDelta, final: bool) -> bool:
        index = self._buffer.find(PARAMETER_END)
        if index < 0:
            return False
        self._emit_value(delta, self._buffer[:index])
        self._buffer = self._buffer[index + len(PARAMETER_END) :]
        self._state = "invoke"
        return True

    def _emit_value(self, delta: ParsedDelta, raw: str) -> None:
        types = schema_types(self._schemas.get(self._call_name, {}).get(self._param_name))
        value = typed_value(raw, types)
        text = json.dumps(value, ensure_ascii=False)
        delta.add_tool_call(ToolCallDelta(self._num_calls - 1, arguments=text))

    def _close_invoke(self, delta: ParsedDelta) -> None:
        closing = "}" if self._num_params else "{}"
        delta.add_tool_call(ToolCallDelta(self._num_calls - 1, arguments=closing))
