"""`--api-key` over real HTTP: without the key (or with another) the API is a 401 with an OpenAI
error body, the official client with the key is served, probes stay open."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.deploy.conftest import app_args

APP = "keyed"
KEY = "s3cret-key"


@pytest.fixture(scope="module")
def keyed_url(serve_url, tiny_model_dir):
    from ray import serve

    from deploy.app import build_app

    args = dict(app_args(tiny_model_dir), api_key=KEY, colocate=True)
    serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    yield f"{serve_url}/{APP}"
    serve.delete(APP)


def test_the_api_needs_the_key(keyed_url):
    for key in ("wrong", None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = httpx.get(f"{keyed_url}/v1/models", headers=headers, timeout=60)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    wrong = openai.OpenAI(base_url=f"{keyed_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    right = openai.OpenAI(base_url=f"{keyed_url}/v1", api_key=KEY, max_retries=0, timeout=60)
    model = right.models.list().data[0].id
    completion = right.completions.create(
        model=model, prompt="def f(x):", max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert completion.usage.completion_tokens == 4
    assert httpx.get(f"{keyed_url}/health", timeout=60).status_code == 200  # probes need no key


def test_the_key_can_come_from_the_environment(monkeypatch):
    """`MTPSERVE_API_KEY` keeps the key off the command line: `mtpserve serve` takes it when
    --api-key is not given, and an ingress whose args carry no key reads it (api_key_from)."""
    from deploy.auth import API_KEY_ENV, api_key_from
    from deploy.cli import build_parser

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert build_parser().parse_args(["serve"]).api_key is None
    assert api_key_from(None) is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert build_parser().parse_args(["serve"]).api_key == "from-env"
    assert build_parser().parse_args(["serve", "--api-key", "flag"]).api_key == "flag"
    assert api_key_from(None) == "from-env"
    assert api_key_from("given") == "given"
