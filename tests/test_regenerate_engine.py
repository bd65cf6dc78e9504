"""Regeneration through the recipe's engine deployment (`data.regenerate.backend: engine`), against loopback fake
OpenAI servers that serve the tiny target greedily: several servers share the conversations and the file is the one a
single server writes; attached hidden-states servers' files are deleted; launch mode starts the section's servers
without the hidden-states method and stops them; bad settings are refused before any work; `plan` reports it."""

from __future__ import annotations

import re
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import test_regenerate_server
from training_fixtures import tiny_recipe, write_chat_jsonl, write_recipe

from eagle3_zoo.data.engine.regenerate_server import regenerate_for_recipe
from eagle3_zoo.data.readers import Conversation
from eagle3_zoo.recipe.sections import RecipeError, load_recipe

tiny = test_regenerate_server.tiny  # the tiny target (a module fixture) and its fake server
_served = test_regenerate_server._served


def _convs(n=7):
    return [Conversation(id=f"c{i}", source="data.jsonl", index=i,
                         messages=[{"role": "user", "content": f"Question number {i}" + " more" * (i % 3)},
                                   {"role": "assistant", "content": "old"},
                                   {"role": "user", "content": "And then?"},
                                   {"role": "assistant", "content": "old"}]) for i in range(n)]


def _recipe(tmp_path, *overrides):
    path = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, tmp_path, write_chat_jsonl(tmp_path / "c.jsonl")))
    return load_recipe(path, ["data.regenerate.enabled=true", "data.regenerate.max_new_tokens=6",
                              "data.regenerate.concurrency=2", "data.regenerate.retries=0", *overrides])


def test_two_attached_servers_share_the_conversations_and_the_file_is_one_servers(tiny, tmp_path):
    model, tok, adapter = tiny
    convs = _convs()
    with _served(model, tok) as one, _served(model, tok) as a, _served(model, tok) as b:
        single = _recipe(tmp_path, "data.regenerate.backend=openai", f"data.regenerate.base_url={one.url}")
        ref, _ = regenerate_for_recipe(single, convs, tok, adapter, tmp_path / "one.jsonl")
        shared = _recipe(tmp_path, "data.regenerate.backend=engine", "engine.mode=attach",
                         f"engine.urls=[{a.url},{b.url}]")
        out, stats = regenerate_for_recipe(shared, convs, tok, adapter, tmp_path / "two.jsonl")
        assert len(a.completions) + len(b.completions) == len(one.completions) == 14
        assert len(a.completions) >= 4 and len(b.completions) >= 4  # both answered a share
        on_a, on_b = ({re.search(r"Question number (\d+)", tok.decode(c["prompt"])).group(1) for c in s.completions}
                      for s in (a, b))
        assert not on_a & on_b and len(on_a | on_b) == 7  # each conversation's turns all go to one server
    assert stats.generated == 7 and stats.turns == 14
    assert [c.messages for c in out] == [c.messages for c in ref]
    assert (tmp_path / "two.jsonl").read_bytes() == (tmp_path / "one.jsonl").read_bytes()


def test_the_rank_split_applies_on_top_of_the_server_split(tiny, tmp_path):
    from eagle3_zoo.data.ranks import RankSplit

    model, tok, adapter = tiny
    convs = _convs()
    with _served(model, tok) as one, _served(model, tok) as a, _served(model, tok) as b:
        single = _recipe(tmp_path, "data.regenerate.backend=openai", f"data.regenerate.base_url={one.url}")
        regenerate_for_recipe(single, convs, tok, adapter, tmp_path / "one.jsonl")
        shared = _recipe(tmp_path, "data.regenerate.backend=engine", "engine.mode=attach",
                         f"engine.urls=[{a.url},{b.url}]")
        out_path = tmp_path / "ranks.jsonl"
        sent = lambda: len(a.completions) + len(b.completions)  # noqa: E731
        # rank 1 of 2 (a thread here) sends its share (the second batch of 4: 3 conversations, 6 answers) to both
        # servers, then waits for rank 0's part
        other = threading.Thread(target=regenerate_for_recipe, args=(shared, convs, tok, adapter, out_path),
                                 kwargs={"split": RankSplit(1, 2)})
        other.start()
        deadline = time.monotonic() + 60
        while sent() < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)
        assert sent() == 6 and len(a.completions) == 4 and len(b.completions) == 2  # its share, over both servers
        regenerate_for_recipe(shared, convs, tok, adapter, out_path, split=RankSplit(0, 2))
        other.join(timeout=120)
        assert not other.is_alive()
        assert sent() == 14
    assert out_path.read_bytes() == (tmp_path / "one.jsonl").read_bytes()


def test_attached_hidden_states_servers_answer_and_their_files_are_deleted(tiny, tmp_path):
    model, tok, adapter = tiny
    store = tmp_path / "hs"
    store.mkdir()
    with _served(model, tok) as one, _served(model, tok) as hs:
        hs.hidden_states_dir = store
        single = _recipe(tmp_path, "data.regenerate.backend=openai", f"data.regenerate.base_url={one.url}")
        ref, _ = regenerate_for_recipe(single, _convs(3), tok, adapter, tmp_path / "one.jsonl")
        attached = _recipe(tmp_path, "data.regenerate.backend=engine", "engine.mode=attach", f"engine.urls=[{hs.url}]",
                           f"engine.hidden_states_dir={store}")
        out, _ = regenerate_for_recipe(attached, _convs(3), tok, adapter, tmp_path / "hs.jsonl")
        assert len(hs.completions) == 6
    assert [c.messages for c in out] == [c.messages for c in ref]
    assert list(store.iterdir()) == []  # every file the server wrote (and its lock) is gone


class _FakeProcess:
    """Stands in for `targets.server.VLLMServer` in launch mode: records its arguments, serves the tiny target."""

    made: list = []

    def __init__(self, model, **kwargs):
        self.model, self.kwargs, self.fake, self.proc, self.port = model, kwargs, None, None, None
        self.log_path = kwargs.get("log_path")
        type(self).made.append(self)

    def start(self):
        self.fake = _served(*type(self).target, port=self.port or 0).__enter__()  # a restart: the same port
        self.base_url = self.fake.url
        return self

    def stop(self):
        if self.fake is not None:
            self.fake.close()
            self.stopped = True


def test_launch_mode_starts_the_sections_servers_without_hidden_states_and_stops_them(tiny, tmp_path, monkeypatch):
    from eagle3_zoo.targets import deployment

    model, tok, adapter = tiny
    _FakeProcess.made, _FakeProcess.target = [], (model, tok)
    monkeypatch.setattr(deployment, "VLLMServer", _FakeProcess)
    monkeypatch.setattr(deployment, "engine_build", lambda python=None: "cpu")  # a CPU build
    with _served(model, tok) as one:
        single = _recipe(tmp_path, "data.regenerate.backend=openai", f"data.regenerate.base_url={one.url}")
        regenerate_for_recipe(single, _convs(), tok, adapter, tmp_path / "one.jsonl")
    launch = _recipe(tmp_path, "data.regenerate.backend=engine", "engine.replicas=2", "engine.tensor_parallel_size=2",
                     "engine.devices='0,1,2,3'", "engine.extra_args=[--max-num-seqs,'8']",
                     f"engine.python={sys.executable}")
    regenerate_for_recipe(launch, _convs(), tok, adapter, tmp_path / "launch.jsonl")
    assert (tmp_path / "launch.jsonl").read_bytes() == (tmp_path / "one.jsonl").read_bytes()
    assert len(_FakeProcess.made) == 2 and all(getattr(p, "stopped", False) for p in _FakeProcess.made)
    assert all(len(p.fake.completions) >= 4 for p in _FakeProcess.made)  # both replicas answered a share
    for p in _FakeProcess.made:
        kw = p.kwargs
        assert kw["speculative_config"] is None and kw["kv_transfer_config"] is None  # plain vLLM
        assert kw["max_model_len"] == 128 + 6  # data.max_length + data.regenerate.max_new_tokens
        assert kw["extra_args"] == ["--tensor-parallel-size", "2", "--max-num-seqs", "8"]
        assert "PYTHONPATH" not in kw["env"]
    assert [p.kwargs["env"]["VLLM_CPU_OMP_THREADS_BIND"] for p in _FakeProcess.made] == ["0|1", "2|3"]
    _FakeProcess.made = []
    regenerate_for_recipe(launch, _convs(), tok, adapter, tmp_path / "launch.jsonl")  # all cached: nothing started
    assert _FakeProcess.made == []


class _DiesOnce(_FakeProcess):
    """A launched server whose first process dies after 3 answers (its later requests fail, `poll()` says it
    exited); started again it serves on."""

    deaths = 1

    def start(self):
        super().start()
        fake, dies = self.fake, _DiesOnce.deaths > 0
        _DiesOnce.deaths -= dies
        if dies:
            fake.fail_after = 3
        self.proc = SimpleNamespace(poll=lambda: 1 if dies and len(fake.completions) >= 3 else None, returncode=1)
        return self


@pytest.mark.parametrize("restarts", [2, 0])
def test_a_launched_server_that_dies_is_restarted_and_the_regeneration_resumes(tiny, tmp_path, monkeypatch, caplog,
                                                                               restarts):
    from eagle3_zoo.targets import deployment
    from eagle3_zoo.targets.openai_client import ServerError

    model, tok, adapter = tiny
    _DiesOnce.made, _DiesOnce.target, _DiesOnce.deaths = [], (model, tok), 1
    monkeypatch.setattr(deployment, "VLLMServer", _DiesOnce)
    monkeypatch.setattr(deployment, "engine_build", lambda python=None: "cpu")  # a CPU build
    with _served(model, tok) as one:
        single = _recipe(tmp_path, "data.regenerate.backend=openai", f"data.regenerate.base_url={one.url}")
        regenerate_for_recipe(single, _convs(), tok, adapter, tmp_path / "one.jsonl")
    launch = _recipe(tmp_path, "data.regenerate.backend=engine", f"engine.max_restarts={restarts}",
                     f"engine.python={sys.executable}")
    if not restarts:  # restarts spent: the run stops, keeping what was answered
        with pytest.raises(ServerError, match="regeneration through .* stopped: .*rerun to answer the rest"):
            regenerate_for_recipe(launch, _convs(), tok, adapter, tmp_path / "launch.jsonl")
        return
    with caplog.at_level("WARNING"):
        regenerate_for_recipe(launch, _convs(), tok, adapter, tmp_path / "launch.jsonl")
    records = test_regenerate_server._records  # sorted by index: a resumed file appends what it answered later
    assert records(tmp_path / "launch.jsonl") == records(tmp_path / "one.jsonl")
    (proc,) = _DiesOnce.made
    assert proc.port == int(proc.fake.url.rsplit(":", 1)[1])  # started again on its port
    assert "restarting it (1 of 2" in caplog.text and "back after" in caplog.text


@pytest.mark.parametrize(("overrides", "key", "words"), [
    (["data.regenerate.backend=engine", "data.regenerate.base_url=http://127.0.0.1:8001"],
     "data.regenerate.base_url", "is for backend openai"),
    (["data.regenerate.backend=engine", "engine.max_model_len=130"], "engine.max_model_len",
     "at least data.max_length + data.regenerate.max_new_tokens (128 + 6)"),
    (["data.regenerate.backend=engine", "engine.mode=attach"], "engine.mode", "attach needs the servers' URLs"),
    (["data.regenerate.backend=sglang"], "data.regenerate.backend", "engine"),
])
def test_bad_engine_regeneration_settings_are_refused_in_one_line_each(tmp_path, overrides, key, words):
    with pytest.raises(RecipeError) as err:
        _recipe(tmp_path, *overrides)
    lines = [line for line in str(err.value).splitlines() if key in line]
    assert lines and words in lines[0], str(err.value)


def test_print_config_shows_the_engine_backend(tmp_path, capsys):
    from eagle3_zoo.cli import main

    path = write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, tmp_path, write_chat_jsonl(tmp_path / "c.jsonl")))
    assert main(["fit", str(path), "--print-config", "data.regenerate.enabled=true",
                 "data.regenerate.backend=engine"]) == 0
    out = capsys.readouterr().out
    assert "backend: engine" in out
