"""DeepSeek-V3.2's own chat encoding: OpenAI-shaped messages -> the prompt text the model was
trained on.

DeepSeek-V3.2 ships no Jinja chat template; its format is defined by Python in the model
repository (`encoding/encoding_dsv32.py`, checked against its `test_input.json` /
`test_output.txt`). This is our own implementation of that format, byte for byte:

    <｜begin▁of▁sentence｜>{system}[\\n\\n{tools block}]
    <｜User｜>{user}<｜Assistant｜>{opener}
    {reasoning</think> when rendered}{content}[\\n\\n{DSML tool calls}]<｜end▁of▁sentence｜>
    \\n\\n<function_results>\\n<result>{tool 1}</result>...\\n</function_results>\\n\\n{opener}

(newlines above are only for reading; nothing separates the turns). The opener after a user
turn or a closed block of tool results is `<think>` in thinking mode when that turn is at or after
the last user message, and `</think>` otherwise. An assistant turn's reasoning is rendered only
in thinking mode and only after the last user message (earlier reasoning is dropped). Tool
results are matched to the preceding assistant's calls by position. DSML markers are plain text,
not special tokens. The tools block keeps every blank line of DeepSeek's text (the Python copies
in two popular serving engines drop seven of them).
"""

from __future__ import annotations

import json
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
FUNCTION_CALLS_START = f"<{DSML}function_calls>"
FUNCTION_CALLS_END = f"</{DSML}function_calls>"
INVOKE_END = f"</{DSML}invoke>"
PARAMETER_END = f"</{DSML}parameter>"

USER_ROLES = ("user", "developer")

# DeepSeek's tools block, verbatim (a format, not code: the model was trained on these bytes).
TOOLS_PREAMBLE = f"""## Tools

You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{DSML}function_calls>" block like the following as part of your reply to the user:
<{DSML}function_calls>
<{DSML}invoke name="$FUNCTION_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$FUNCTION_NAME2">
...
</{DSML}invoke>
</{DSML}function_calls>

String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).

If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:

<{DSML}function_calls>
...
</{DSML}function_calls>

<function_results>
...
</function_results>

{THINK_START}...thinking about results{THINK_END}

Here are the functions available in JSONSchema format:
<functions>
"""  # noqa: E501 - DeepSeek's lines


class ChatEncodingError(ValueError):
    """The messages cannot be rendered in DeepSeek-V3.2's format (a 400 for the client)."""


def to_json(value: Any) -> str:
    """JSON as DeepSeek writes it: `json.dumps` separators, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False)


def render_tools(functions: list[dict[str, Any]]) -> str:
    """The tools block for OpenAI `function` objects (name, description, parameters)."""
    return TOOLS_PREAMBLE + "\n".join(to_json(f) for f in functions) + "\n</functions>\n"


def render_parameter(name: str, value: Any) -> str:
    """One DSML parameter: strings raw, every other value as JSON."""
    is_str = isinstance(value, str)
    text = value if is_str else to_json(value)
    flag = "true" if is_str else "false"
    return f'<{DSML}parameter name="{name}" string="{flag}">{text}{PARAMETER_END}'


def render_tool_calls(tool_calls: list[dict[str, Any]]) -> str:
    """An assistant's OpenAI `tool_calls` as one DSML block, with its leading blank line."""
    invokes = []
    for call in tool_calls:
        function = call.get("function") or {}
        name = function.get("name")
        arguments = function.get("arguments") or "{}"
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                raise ChatEncodingError(
                    f"tool call {name!r}: arguments are not valid JSON: {exc}"
                ) from exc
        if not isinstance(arguments, dict):
            raise ChatEncodingError(f"tool call {name!r}: arguments must be a JSON object")
        params = "\n".join(render_parameter(k, v) for k, v in arguments.items())
        invokes.append(f'<{DSML}invoke name="{name}">\n{params}\n{INVOKE_END}')
    return f"\n\n{FUNCTION_CALLS_START}\n" + "\n".join(invokes) + f"\n{FUNCTION_CALLS_END}"


def last_user_index(messages: list[dict[str, Any]]) -> int:
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].get("role") in USER_ROLES:
            return index
    return -1


def _opener(thinking_here: bool) -> str:
    return THINK_START if thinking_here else THINK_END


def _tool_position(messages: list[dict[str, Any]], index: int) -> tuple[int, int]:
    """(1-based position of tool message `index` among its assistant's results, number of calls)."""
    owner = index - 1
    while owner >= 0 and messages[owner].get("role") == "tool":
        owner -= 1
    calls = messages[owner].get("tool_calls") if owner >= 0 else None
    if owner < 0 or messages[owner].get("role") != "assistant" or not calls:
        raise ChatEncodingError(
            f"messages[{index}]: a tool message must follow an assistant message with tool_calls"
        )
    position = index - owner
    if position > len(calls):
        raise ChatEncodingError(
            f"messages[{index}]: more tool results than the assistant's {len(calls)} tool calls"
        )
    return position, len(calls)


def render_message(
    messages: list[dict[str, Any]], index: int, thinking: bool, last_user: int
) -> str:
    message = messages[index]
    role = message.get("role")
    content = message.get("content") or ""
    if role == "system":
        text = content
        if message.get("tools"):
            text += "\n\n" + render_tools(message["tools"])
        return text
    if role in USER_ROLES:
        if role == "developer":
            text = ""
            if message.get("tools"):
                text += "\n\n" + render_tools(message["tools"])
            text += f"\n\n# The user's message is: {content}"
        else:
            text = content
        return USER + text + ASSISTANT + _opener(thinking and index == last_user)
    if role == "tool":
        position, num_calls = _tool_position(messages, index)
        text = "\n\n<function_results>" if position == 1 else ""
        text += f"\n<result>{content}</result>"
        if position == num_calls:
            text += "\n</function_results>\n\n" + _opener(thinking and index >= last_user)
        return text
    if role == "assistant":
        reasoning = ""
        if thinking and index > last_user:
            reasoning = (message.get("reasoning_content") or "") + THINK_END
        calls = render_tool_calls(message["tool_calls"]) if message.get("tool_calls") else ""
        return reasoning + content + calls + EOS
    raise ChatEncodingError(f"messages[{index}]: unknown role {role!r}")


def attach_tools(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The request's OpenAI `tools` go to the system message: the first message when it is a
    system message, otherwise a new empty one inserted at the front (which renders as a blank
    line and the tools block right after the BOS token)."""
    if not tools:
        return messages
    functions = [tool.get("function", tool) for tool in tools]
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "tools": functions}, *messages[1:]]
    return [{"role": "system", "content": "", "tools": functions}, *messages]


def encode_messages(
    messages: list[dict[str, Any]],
    *,
    thinking: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The whole prompt for OpenAI-shaped `messages` (content already text; assistant
    `tool_calls` with JSON-string arguments; `reasoning_content` optional). A conversation
    ending with a user turn or a closed block of tool results ends with the opener the model
    continues from, so there is no separate generation prompt."""
    messages = attach_tools(messages, tools)
    last_user = last_user_index(messages)
    return BOS + "".join(
        render_message(messages, index, thinking, last_user) for index in range(len(messages))
    )
