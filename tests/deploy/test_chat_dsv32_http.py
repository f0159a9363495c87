"""DeepSeek-V3.2 chat over real HTTP with the official `openai` client: the built-in encoder,
thinking mode, tool calls (streamed and not), /tokenize, /detokenize and /v1/models/{id}.

The checkpoint (`tests/deploy/dsv32_checkpoint.py`) has DeepSeek-V3's real tokenizer and no chat
template; the scripted executor answers a request sampled with seed s with the tokens of
`ANSWERS[s]`, so the whole serving path (scheduler, detokenizer, ingress, parser) runs on known
model text.
"""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest

from deploy.chat_dsv32 import encode_messages
from tests.deploy.conftest import app_args
from tests.deploy.dsv32_checkpoint import EXECUTOR, load_tokenizer, make_dsv32_checkpoint
from tests.deploy.test_chat_dsv32 import (
    ASSISTANT,
    BOS,
    CONVERSATION,
    EOS,
    EXPECTED_THINKING,
    GET_FORECAST,
    TOOLS,
    TOOLS_BLOCK,
    USER,
)

pytestmark = pytest.mark.timeout(300)

APP = "dsv32"
MODEL = "dsv32-chat"

FORECAST_CALL = (
    "\n\n<｜DSML｜function_calls>\n"
    '<｜DSML｜invoke name="get_forecast">\n'
    '<｜DSML｜parameter name="city" string="true">Paris, "Île-de-France"</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜function_calls>"
)
FORECAST_ARGUMENTS = '{"city": "Paris, \\"Île-de-France\\"", "days": 3}'
ANSWERS = {
    1: "Two and two.</think>2 + 2 = 4.",
    2: "The user wants Paris; one call.</think>" + FORECAST_CALL,
    3: FORECAST_CALL,
    4: "Rain in Paris for three days.",
}
QUESTION = [{"role": "user", "content": "Will it rain in Paris this week?"}]
FORECAST_TOOLS = [{"type": "function", "function": GET_FORECAST}]
THINKING = {"chat_template_kwargs": {"thinking": True}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("ckpt") / MODEL)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(make_dsv32_checkpoint(model_dir, {}))


@pytest.fixture(scope="module")
def dsv32_url(serve_url, model_dir, tokenizer):
    from ray import serve

    from deploy.app import build_app

    script = {
        seed: tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        for seed, text in ANSWERS.items()
    }
    make_dsv32_checkpoint(model_dir, script)
    args = app_args(model_dir, executor=EXECUTOR)
    serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    yield f"{serve_url}/{APP}"
    serve.delete(APP)


@pytest.fixture
def client(dsv32_url):
    return openai.OpenAI(base_url=f"{dsv32_url}/v1", api_key="unused", max_retries=0, timeout=60)


def tokenize(url: str, **body) -> dict:
    response = httpx.post(f"{url}/tokenize", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def chat(client, seed: int, **kwargs):
    return client.chat.completions.create(
        model=MODEL, temperature=0.0, seed=seed, **{"messages": QUESTION, **kwargs}
    )


def test_thinking_splits_reasoning_from_content(client):
    response = chat(client, 1, extra_body=THINKING)
    message = response.choices[0].message
    assert message.reasoning_content == "Two and two."
    assert message.content == "2 + 2 = 4."
    assert message.tool_calls is None
    assert response.choices[0].finish_reason == "stop"


def test_thinking_off_by_default_leaves_the_text_alone(client):
    response = chat(client, 1)
    assert response.choices[0].message.content == ANSWERS[1]
    assert response.choices[0].message.model_extra.get("reasoning_content") is None


def test_tool_call_with_thinking_not_streamed(client, dsv32_url):
    response = chat(client, 2, tools=FORECAST_TOOLS, extra_body=THINKING)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "The user wants Paris; one call."
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, call.function.arguments) == ("get_forecast", FORECAST_ARGUMENTS)
    prompt = tokenize(dsv32_url, messages=QUESTION, tools=FORECAST_TOOLS, **THINKING)
    assert response.usage.prompt_tokens == prompt["count"]


def test_tool_call_with_thinking_streamed_incrementally(client, tokenizer):
    chunks = list(
        chat(
            client,
            2,
            tools=FORECAST_TOOLS,
            extra_body=THINKING,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    assert reasoning == "The user wants Paris; one call."
    assert "".join(d.content or "" for d in deltas) == ""
    pieces = [piece for d in deltas for piece in d.tool_calls or []]
    first = pieces[0]
    assert (first.index, first.type, first.function.name) == (0, "function", "get_forecast")
    assert first.id.startswith("call_")
    assert all(p.index == 0 and p.id is None and p.function.name is None for p in pieces[1:])
    arguments = [p.function.arguments for p in pieces]
    assert "".join(arguments) == FORECAST_ARGUMENTS
    # Streamed as the tokens arrive: the string value comes in several fragments.
    assert len([a for a in arguments if a]) >= 5
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == ["tool_calls"]
    answer_ids = tokenizer.encode(ANSWERS[2], add_special_tokens=False)
    assert chunks[-1].usage.completion_tokens == len(answer_ids) + 1  # + EOS


def test_tool_call_round_trip_keeps_calls_and_results_in_the_history(client, dsv32_url, tokenizer):
    first = chat(client, 3, tools=FORECAST_TOOLS)
    [call] = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls"
    history = QUESTION + [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"rain_mm": [4, 9, 2]}'},
    ]
    second = chat(client, 4, tools=FORECAST_TOOLS, messages=history)
    assert second.choices[0].message.content == "Rain in Paris for three days."
    assert second.choices[0].finish_reason == "stop"
    # The prompt of the second turn, byte for byte.
    expected = (
        BOS + "\n\n" + TOOLS_BLOCK.split("{")[0] + json.dumps(GET_FORECAST) + "\n</functions>\n"
        + USER + "Will it rain in Paris this week?" + ASSISTANT + "</think>"
        + FORECAST_CALL + EOS
        + '\n\n<function_results>\n<result>{"rain_mm": [4, 9, 2]}</result>\n</function_results>'
        + "\n\n</think>"
    )  # fmt: skip
    prompt = tokenize(dsv32_url, messages=history, tools=FORECAST_TOOLS)
    assert tokenizer.decode(prompt["tokens"]) == expected
    assert prompt["tokens"] == tokenizer.encode(expected, add_special_tokens=False)
    assert second.usage.prompt_tokens == prompt["count"]


def test_tool_call_streamed_without_thinking_equals_not_streamed(client):
    whole = chat(client, 3, tools=FORECAST_TOOLS).choices[0]
    chunks = list(chat(client, 3, tools=FORECAST_TOOLS, stream=True))
    pieces = [p for c in chunks if c.choices for p in c.choices[0].delta.tool_calls or []]
    assert pieces[0].function.name == whole.message.tool_calls[0].function.name
    assert "".join(p.function.arguments or "" for p in pieces) == FORECAST_ARGUMENTS
    assert whole.message.tool_calls[0].function.arguments == FORECAST_ARGUMENTS


def test_tokenize_the_vector_shaped_conversation_byte_exact(dsv32_url, client, tokenizer):
    result = tokenize(dsv32_url, messages=CONVERSATION, tools=TOOLS, **THINKING)
    assert tokenizer.decode(result["tokens"]) == EXPECTED_THINKING
    assert result["tokens"] == tokenizer.encode(EXPECTED_THINKING, add_special_tokens=False)
    assert result["count"] == len(result["tokens"])
    assert result["max_model_len"] == client.models.retrieve(MODEL).model_extra["max_model_len"]


def test_tokenize_chat_mode_and_thinking_mode_openers(dsv32_url, tokenizer):
    chat_mode = tokenize(dsv32_url, messages=QUESTION, return_token_strs=True)
    text = BOS + USER + "Will it rain in Paris this week?" + ASSISTANT
    assert chat_mode["tokens"] == tokenizer.encode(text + "</think>", add_special_tokens=False)
    assert chat_mode["token_strs"][:2] == [BOS, USER]
    assert chat_mode["token_strs"][-2:] == [ASSISTANT, "</think>"]
    thinking = tokenize(dsv32_url, messages=QUESTION, **THINKING)
    assert thinking["tokens"] == tokenizer.encode(text + "<think>", add_special_tokens=False)
    assert (chat_mode["tokens"][-1], thinking["tokens"][-1]) == (128799, 128798)


def test_tokenize_prompt_and_detokenize(dsv32_url):
    result = tokenize(dsv32_url, prompt="Hello, Kyōto!")
    back = httpx.post(
        f"{dsv32_url}/detokenize", json={"model": MODEL, "tokens": result["tokens"]}, timeout=60
    )
    assert back.status_code == 200 and back.json() == {"prompt": "Hello, Kyōto!"}
    bad = httpx.post(f"{dsv32_url}/detokenize", json={"tokens": [-1]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_model_by_id(client):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_tool_choice_required_is_refused(client):
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, 3, tools=FORECAST_TOOLS, tool_choice="required")
    assert error.value.response.json()["error"]["param"] == "tool_choice"


def test_tool_choice_none_hides_tools_and_parses_no_calls(client, dsv32_url):
    response = chat(client, 3, tools=FORECAST_TOOLS, tool_choice="none")
    assert response.choices[0].message.content == FORECAST_CALL
    assert response.choices[0].message.tool_calls is None
    assert response.choices[0].finish_reason == "stop"
    assert (
        tokenize(dsv32_url, messages=QUESTION, tools=FORECAST_TOOLS, tool_choice="none")["tokens"]
        == tokenize(dsv32_url, messages=QUESTION)["tokens"]
    )


def test_chat_format_follows_the_checkpoint(model_dir, tokenizer, tiny_model_dir):
    from transformers import AutoTokenizer

    from deploy.openai_serving import ChatFormat

    assert ChatFormat.for_checkpoint(model_dir, tokenizer) == ChatFormat(True, True)
    own = AutoTokenizer.from_pretrained(tiny_model_dir)  # deepseek_v32 with its own template
    assert ChatFormat.for_checkpoint(tiny_model_dir, own) == ChatFormat(False, True)
    assert ChatFormat.for_checkpoint("/nonexistent", tokenizer) == ChatFormat(False, False)


def test_own_template_receives_tools_and_template_kwargs(tiny_model_dir):
    from transformers import AutoTokenizer

    from deploy.openai_protocol import ChatCompletionRequest
    from deploy.openai_serving import ChatFormat

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = (
        "{{ tools | map(attribute='function.name') | join(',') }}|{{ mood }}|"
        "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }};{% endfor %}"
    )
    request = ChatCompletionRequest(
        model="m",
        messages=QUESTION,
        tools=FORECAST_TOOLS,
        chat_template_kwargs={"mood": "sunny"},
    )
    assert ChatFormat(False, True).prompt_text(request, tokenizer) == (
        "get_forecast|sunny|user:Will it rain in Paris this week?;"
    )


def test_batch_job_prompt_uses_the_builtin_encoder(tokenizer):
    from deploy.batch import _prompt_token_ids

    request = {"messages": CONVERSATION[:9], "tools": TOOLS, **THINKING}
    expected = EXPECTED_THINKING[: EXPECTED_THINKING.index("One call is enough.")]
    assert _prompt_token_ids(request, tokenizer) == tokenizer.encode(
        expected, add_special_tokens=False
    )


def test_tokenize_shows_tools_in_the_clients_key_order(dsv32_url, tokenizer):
    """DeepSeek's prompt is each tool's JSON as the client wrote it; a server that dumps its own
    field order (name, description, parameters) would show the model other bytes."""
    function = {
        "parameters": {
            "type": "object",
            "required": ["days", "city"],
            "properties": {"days": {"type": "integer"}, "city": {"type": "string"}},
        },
        "name": "get_forecast",
        "description": "Rain forecast",
    }
    tools = [{"function": function, "type": "function"}]
    result = tokenize(dsv32_url, messages=QUESTION, tools=tools)
    expected = encode_messages(QUESTION, thinking=False, tools=tools)
    assert json.dumps(function, ensure_ascii=False) in expected
    assert tokenizer.decode(result["tokens"]) == expected


@pytest.mark.skipif(
    not os.environ.get("DSV32_ENCODING_DIR"),
    reason="set DSV32_ENCODING_DIR to a copy of DeepSeek-V3.2's encoding/ folder",
)
def test_tokenize_deepseeks_own_test_vector(dsv32_url, tokenizer):
    """DeepSeek's official vector through the HTTP path (see test_chat_dsv32.py)."""
    folder = os.environ["DSV32_ENCODING_DIR"]
    with open(os.path.join(folder, "test_input.json"), encoding="utf-8") as f:
        vector = json.load(f)
    with open(os.path.join(folder, "test_output.txt"), encoding="utf-8") as f:
        expected = f.read()
    result = tokenize(dsv32_url, messages=vector["messages"], tools=vector["tools"], **THINKING)
    assert tokenizer.decode(result["tokens"]) + "\n" == expected
