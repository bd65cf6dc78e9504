"""An OpenAI-compatible server that misbehaves, on loopback (tests/openai_fake.py): garbage answers are refused and
never cached (or skipped and counted with `on_error: skip`), redirects never carry the API key to another origin nor
turn a POST into a GET, credentials in URLs are refused, no message holds the key, a trickling answer hits the
request's deadline, and bad client settings are refused by the recipe and the client, each in one line."""

from __future__ import annotations

import json
import time

import pytest
from openai_fake import FakeOpenAIServer
from training_fixtures import tiny_llama_target

from eagle3_zoo.data.engine.regenerate_server import regenerate_with_client
from eagle3_zoo.data.readers import Conversation
from eagle3_zoo.targets.openai_client import BadAnswerError, OpenAIClient, ServerError

KEY = "sk-FAKE-0123456789abcdef"  # a fake API key: it must never show up in a message


@pytest.fixture(scope="module")
def tiny():
    _, tok, adapter = tiny_llama_target()
    return tok, adapter


def _server(tok) -> FakeOpenAIServer:
    """Answers every turn with three in-vocabulary ids and the end-of-sequence id."""
    return FakeOpenAIServer(generate=lambda prompt, max_tokens, stop: [10, 11, 12, *(stop[:1] or [tok.eos_token_id])])


def _convs(n: int = 2) -> list[Conversation]:
    return [Conversation(id=f"c{i}", source="data.jsonl", index=i, messages=[
        {"role": "user", "content": f"Hello {i}"}, {"role": "assistant", "content": "old"}]) for i in range(n)]


def _regen(server, tok, adapter, path, **kw):
    return regenerate_with_client(_convs(), OpenAIClient(server.url, retries=0), tok, adapter, path,
                                  max_new_tokens=8, concurrency=1, **kw)


GARBAGE = {  # name -> (the server's completion body, what the refusal says)
    "null_text_and_ids": ({"choices": [{"text": None, "token_ids": None}]}, "neither 'token_ids' nor a 'text'"),
    "object_text": ({"choices": [{"text": {"a": 1}}]}, "'text' is a JSON dict, not a string"),
    "ids_outside_the_vocabulary": ({"choices": [{"token_ids": [5, 99999]}]}, "outside the tokenizer's vocabulary"),
    "negative_id": ({"choices": [{"token_ids": [-1, 5]}]}, "outside the tokenizer's vocabulary"),
    "string_ids": ({"choices": [{"token_ids": ["a", "b"]}]}, "'token_ids' is not a list of integers"),
    "float_ids": ({"choices": [{"token_ids": [1.5]}]}, "'token_ids' is not a list of integers"),
    "empty_answer_cut_by_length": ({"choices": [{"token_ids": [], "finish_reason": "length"}]}, "an empty answer"),
    "no_choices": ({"id": "x"}, "expected 'choices' to be a non-empty list of objects, got no 'choices'"),
    "empty_choices": ({"choices": []}, "expected 'choices' to be a non-empty list"),
    "choices_not_a_list": ({"choices": "abc"}, "expected 'choices' to be a non-empty list"),
    "not_json": (b"<html>busy</html>", "/v1/completions: the answer is not JSON"),
    "not_utf8": (b"\xff\xfe{", "/v1/completions: the answer is not UTF-8 text"),
    "json_list": (b"[1, 2]", "expected a JSON object, got a JSON list"),
}


@pytest.mark.parametrize("name", list(GARBAGE))
def test_garbage_answer_is_refused_and_never_cached(tiny, tmp_path, name):
    tok, adapter = tiny
    body, why = GARBAGE[name]
    path = tmp_path / "answers.jsonl"
    with _server(tok) as server:
        server.answer = body
        with pytest.raises(BadAnswerError) as refused:
            _regen(server, tok, adapter, path)
        message = str(refused.value)
        assert why in message and server.url in message and "conversation data.jsonl#0" in message
        assert "\n" not in message and "data.on_error=skip" in message
        assert not path.exists() or path.read_text() == ""  # nothing cached
        out, stats = _regen(server, tok, adapter, path, on_error="skip")  # skipped and counted, still not cached
        assert out == [] and stats.skipped["server_answer_refused"] == 2 and stats.generated == 0
        assert path.read_text() == ""
        server.answer = None  # the server is fixed: the next run asks again
        out, stats = _regen(server, tok, adapter, path)
    assert stats.generated == 2 and [c.messages[-1]["content"] for c in out] == [tok.decode([10, 11, 12])] * 2


def test_an_empty_answer_that_stopped_at_once_is_kept(tiny, tmp_path):
    tok, adapter = tiny
    with _server(tok) as server:
        server.answer = {"choices": [{"token_ids": [tok.eos_token_id], "finish_reason": "stop"}]}
        out, stats = _regen(server, tok, adapter, tmp_path / "a.jsonl")
    assert stats.generated == 2 and out[0].messages[-1] == {"role": "assistant", "content": ""}


def test_models_listing_is_checked():
    with FakeOpenAIServer() as server:
        server.model = None
        with pytest.raises(BadAnswerError, match=r"/v1/models: expected .* at least one served model"):
            OpenAIClient(server.url).models()


def test_redirect_to_another_origin_never_gets_the_key(monkeypatch):
    monkeypatch.setenv("FAKE_KEY", KEY)
    with FakeOpenAIServer() as other, FakeOpenAIServer() as server:
        for status in (302, 307, 308):
            server.redirect = (status, other.url + "/v1/completions")
            client = OpenAIClient(server.url, api_key_env="FAKE_KEY", retries=2, backoff=0.01)
            with pytest.raises(ServerError, match=rf"HTTP {status} redirect to another origin \({other.url}/v1/"
                                                  r"completions\) not followed \(the API key would be sent there\)"):
                client.post("/v1/completions", {"prompt": [1], "max_tokens": 1})
        assert other.requests == [] and other.headers == []  # not contacted at all: no key, no body
        assert len(server.requests) == 3  # refused at once, not retried


def test_redirect_never_turns_a_post_into_a_get():
    with FakeOpenAIServer() as server:
        server.redirect, server.redirect_path = (302, "/v1/completions"), "/v1/old-completions"
        client = OpenAIClient(server.url, retries=0)
        with pytest.raises(ServerError, match=r"HTTP 302 redirect of a POST to .*/v1/completions not followed \(it "
                                              r"would turn the POST into a GET without its body\)"):
            client.post("/v1/old-completions", {"prompt": [1], "max_tokens": 1})
        assert server.requests == [("POST", "/v1/old-completions")]  # no GET followed
        server.redirect = (307, "/v1/completions")  # keeps the method and the body: followed
        assert client.post("/v1/old-completions", {"prompt": [5], "max_tokens": 2})["choices"][0]["token_ids"] == [
            9, 10]
        assert server.requests[-1] == ("POST", "/v1/completions") and server.completions[-1]["prompt"] == [5]
        server.redirect, server.redirect_path = (301, "/v1/models"), "/models"  # a GET may follow any same-origin one
        assert client.decode_json("/models", client.request("/models"))["data"][0]["id"] == "fake-model"


def test_credentials_in_the_url_are_refused_without_being_printed(tmp_path):
    with pytest.raises(ValueError) as refused:
        OpenAIClient(f"http://user:{KEY}@127.0.0.1:8000")
    assert KEY not in str(refused.value) and "credentials in the URL (user:password@) are refused" in str(
        refused.value) and "http://***@127.0.0.1:8000" in str(refused.value)
    with pytest.raises(ValueError) as pasted:  # the key itself where its variable's name belongs
        OpenAIClient("http://127.0.0.1:8000", api_key_env=KEY)
    assert KEY not in str(pasted.value) and "NAME of an environment variable" in str(pasted.value)

    from training_fixtures import tiny_recipe, write_chat_jsonl, write_recipe

    from eagle3_zoo.recipe.sections import RecipeError, load_recipe

    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, tmp_path, write_chat_jsonl(tmp_path / "c.jsonl")))
    with pytest.raises(RecipeError) as bad:
        load_recipe(recipe, ["data.regenerate.backend=openai", f"data.regenerate.base_url=http://me:{KEY}@h:1",
                             f"data.regenerate.api_key_env={KEY}"])
    text = str(bad.value)
    assert KEY not in text and "data.regenerate.base_url = 'http://***@h:1': credentials in the URL" in text
    assert "data.regenerate.api_key_env = '***': must be the NAME of an environment variable" in text


def test_a_server_quoting_the_key_in_its_error_is_scrubbed(monkeypatch):
    monkeypatch.setenv("FAKE_KEY", KEY)
    with FakeOpenAIServer() as server:
        server.echo_auth = True
        with pytest.raises(ServerError) as failed:
            OpenAIClient(server.url, api_key_env="FAKE_KEY").post("/v1/completions", {"prompt": [1]})
    assert KEY not in str(failed.value) and "bad key Bearer ***" in str(failed.value)


def test_a_trickling_answer_hits_the_deadline_of_the_request():
    with FakeOpenAIServer() as server:
        server.trickle = 0.05  # ~200 bytes: 10 s, each byte well within any per-read timeout
        client = OpenAIClient(server.url, timeout=0.5, retries=1, backoff=0.01)
        start = time.monotonic()
        with pytest.raises(ServerError, match=r"no complete answer within 0.5 s \(the deadline of one request\) "
                                              r"\(2 attempts\)"):
            client.post("/v1/completions", {"prompt": [1], "max_tokens": 40})
        assert time.monotonic() - start < 3.0


@pytest.mark.parametrize("setting, value, message", [
    ("retries", -1, "retries = -1; expected an integer >= 0"),
    ("timeout", 0, "timeout = 0; expected a number of seconds > 0"),
    ("timeout", -1, "timeout = -1; expected a number of seconds > 0"),
    ("timeout", float("nan"), "timeout = nan; expected a number of seconds > 0")])
def test_bad_client_settings_are_refused(tmp_path, setting, value, message):
    with pytest.raises(ValueError, match=message):
        OpenAIClient("http://127.0.0.1:8000", **{setting: value})
    from training_fixtures import tiny_recipe, write_chat_jsonl, write_recipe

    from eagle3_zoo.recipe.sections import RecipeError, load_recipe

    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, tmp_path, write_chat_jsonl(tmp_path / "c.jsonl")))
    with pytest.raises(RecipeError, match=rf"data.regenerate.{setting} = "):
        load_recipe(recipe, [f"data.regenerate.{setting}={json.dumps(value) if value == value else '.nan'}"])
