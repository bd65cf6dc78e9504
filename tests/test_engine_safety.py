"""The engine path against servers that lie, stall or die (loopback fakes of vLLM hidden-states servers,
tests/engine_fake.py): an answer is checked in full (file name, the file, dtype, shapes, finiteness, keys, format)
before anything is read or deleted, as the server's fault naming the server and the file, and a bad answer fails
over to a healthy server; a lock that is never released ends at a deadline; a launched server is restarted as many
times as `engine.max_restarts` says; the engine key is sent by every client and given to launched servers by name;
`serve` binds loopback unless told otherwise and never prints a key."""

from __future__ import annotations

import copy
import fcntl
import itertools
import os
import threading
import time
from types import SimpleNamespace

import pytest
import test_engine_stream
import torch
from engine_fake import FakeHiddenStatesServer, tiny_states
from safetensors.torch import save_file
from training_fixtures import tiny_recipe, write_chat_jsonl, write_recipe

from eagle3_zoo.cli import main
from eagle3_zoo.data.engine.feed import EngineFeed, EngineFeedError
from eagle3_zoo.recipe.sections import load_recipe
from eagle3_zoo.targets.deployment import EngineDeployment
from eagle3_zoo.targets.openai_client import BadAnswerError, ServerError
from eagle3_zoo.targets.vllm_features import answered_file, read_hidden_states

tiny = test_engine_stream.tiny  # the tiny target (a module fixture)
AUX, HIDDEN = test_engine_stream.AUX, 64
LAYERS = len(AUX) + 1


def _recipe(tiny, tmp_path, **engine):
    tmp, target, _, _ = tiny
    data = write_chat_jsonl(tmp_path / "chat.jsonl", n=4)
    return load_recipe(write_recipe(tmp_path / "r.yaml", tiny_recipe(tmp_path, target, data, engine=engine)))


def _feed(tiny, tmp_path, urls, storage, **engine):
    recipe = _recipe(tiny, tmp_path, mode="attach", urls=urls, hidden_states_dir=str(storage), retries=0, **engine)
    feed = EngineFeed(EngineDeployment(recipe, AUX, 4), "e3ztestr0", 2**30, concurrency=2,
                      hidden_size=tiny[2].config.hidden_size).start()
    for server in feed.deployment.servers:
        server.client.backoff = 0.01
    return feed


def _served(tiny, storage, **kwargs):
    return FakeHiddenStatesServer(tiny_states(copy.deepcopy(tiny[2]), AUX), storage, **kwargs)


IDS = [5, 17, 42, 7, 99]


# ------------------------------------------------------------------------------------------ the answer's name
@pytest.mark.parametrize("named", [".", "..", "", "/", "sub/..", "cmpl-e3zr-1-x.safetensors\0.txt", "/etc/passwd",
                                   "cmpl-OTHER-1-abc.safetensors", "cmpl-e3zr-1-abc.json"])
def test_an_answer_naming_anything_but_this_requests_file_is_refused_untouched(tmp_path, named):
    with pytest.raises(BadAnswerError, match=r"http://s:1 answered with hidden_states_path .*nothing was read or "
                                             "deleted"):
        answered_file(named, tmp_path, "e3zr-1", server="http://s:1")
    assert answered_file("/elsewhere/cmpl-e3zr-1-0-ab12.safetensors", tmp_path, "e3zr-1") == \
        tmp_path / "cmpl-e3zr-1-0-ab12.safetensors"  # the server's directory as this machine sees it


def test_another_runs_file_named_by_a_lying_server_is_not_read_or_deleted(tiny, tmp_path):
    storage = tmp_path / "hs"
    with _served(tiny, storage) as server:
        theirs = storage / "cmpl-e3zOTHERr0-t3-deadbeef-0-x.safetensors"  # another run's pending states
        save_file({"hidden_states": torch.zeros(5, LAYERS, HIDDEN), "token_ids": torch.tensor(IDS)}, str(theirs))
        server.tamper = lambda answer, file: {**answer, "kv_transfer_params": {"hidden_states_path": str(theirs)}}
        feed = _feed(tiny, tmp_path, [server.url], storage)
        try:
            with pytest.raises(EngineFeedError, match=rf"{server.url} answered with hidden_states_path .*not a "
                                                      "connector file of this request"):
                feed.submit(IDS, "t1").result()
        finally:
            feed.close()
        assert theirs.exists()  # failed before the fix: read, then deleted when its token ids did not match


# ------------------------------------------------------------------------------------------- the file itself
def _file(tmp_path, name="cmpl-r-0-x.safetensors", **tensors):
    path = tmp_path / name
    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize("case, match", [
    ("int64", "dtype int64; expected a floating-point"), ("bool", "dtype bool; expected a floating-point"),
    ("nan", "values are NaN or infinite"), ("inf", "values are NaN or infinite"),
    ("hidden", r"shape \[5, 4, 32\], expected \[5, 4, 64\]"), ("tokens", "of 4 tokens for a prompt of 5"),
    ("layers", r"shape \[5, 3, 64\]"), ("no_ids", "no token_ids tensor"), ("float_ids", "token_ids of dtype float32"),
    ("not_safetensors", "not a readable safetensors file"), ("directory", "not a regular file"),
    ("missing", r"no such file after 0.2 s \(engine.timeout\)")])
def test_a_bad_file_is_the_servers_fault_naming_it(tmp_path, case, match):
    ok = torch.randn(5, LAYERS, HIDDEN)
    ids = torch.tensor(IDS)
    path = tmp_path / "cmpl-r-0-x.safetensors"
    if case == "int64":
        _file(tmp_path, hidden_states=ok.long(), token_ids=ids)
    elif case == "bool":
        _file(tmp_path, hidden_states=ok > 0, token_ids=ids)
    elif case in ("nan", "inf"):
        bad = ok.clone()
        bad[2, 1, 3] = float(case)
        _file(tmp_path, hidden_states=bad, token_ids=ids)
    elif case == "hidden":
        _file(tmp_path, hidden_states=ok[..., :32].contiguous(), token_ids=ids)
    elif case == "tokens":
        _file(tmp_path, hidden_states=ok[:4].contiguous(), token_ids=ids[:4].contiguous())
    elif case == "layers":
        _file(tmp_path, hidden_states=ok[:, :3].contiguous(), token_ids=ids)
    elif case == "no_ids":
        _file(tmp_path, hidden_states=ok)
    elif case == "float_ids":
        _file(tmp_path, hidden_states=ok, token_ids=ids.float())
    elif case == "not_safetensors":
        path.write_bytes(b"<html>502 Bad Gateway</html>")
    elif case == "directory":
        path.mkdir()
    with pytest.raises(BadAnswerError, match=match) as info:  # missing: waited for (engine.timeout), not there
        read_hidden_states(path, IDS, LAYERS, HIDDEN, server="http://s:1", lock_timeout=0.2)
    assert str(info.value).startswith(f"http://s:1: hidden-states file {path}")
    assert not path.is_file()  # this request's own bad file is not left on disk
    good = _file(tmp_path, "cmpl-r-0-y.safetensors", hidden_states=ok, token_ids=ids)
    assert torch.equal(read_hidden_states(good, IDS, LAYERS, HIDDEN), ok) and not good.exists()  # read once


def test_non_finite_states_fail_over_to_the_healthy_server(tiny, tmp_path):
    storage = tmp_path / "hs"
    with _served(tiny, storage) as bad, _served(tiny, storage) as good:
        def poison(answer, file):
            from safetensors.torch import load_file

            data = load_file(str(file))
            data["hidden_states"][0, 0, 0] = float("nan")
            save_file(data, str(file))
            return answer

        bad.tamper = poison
        feed = _feed(tiny, tmp_path, [bad.url, good.url], storage)
        try:
            path = feed.submit(IDS, "t1").result()
            states = feed.read(path, IDS)
        finally:
            feed.close()
        assert bool(torch.isfinite(states).all()) and feed.stats.failovers == 1
        assert feed.stats.per_server == {good.url: 1} and bad.request_ids  # asked first, refused, handed over
        assert not list(storage.iterdir())  # the poisoned file is deleted (it was this request's)


def test_an_answer_without_a_dict_of_kv_transfer_params_names_the_server(tiny, tmp_path):
    storage = tmp_path / "hs"
    with _served(tiny, storage) as server:
        server.tamper = lambda answer, file: {**answer, "kv_transfer_params": ["not", "a", "dict"]}
        feed = _feed(tiny, tmp_path, [server.url], storage)
        try:
            with pytest.raises(EngineFeedError, match=rf"{server.url}: the completion carries no "
                                                      r"kv_transfer_params.hidden_states_path string"):
                feed.submit(IDS, "t1").result()
        finally:
            feed.close()


# ------------------------------------------------------------------------------------------------ deadlines
def test_a_lock_never_released_ends_at_the_deadline(tmp_path):
    path = _file(tmp_path, hidden_states=torch.randn(5, LAYERS, HIDDEN), token_ids=torch.tensor(IDS))
    fd = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a connector that died holding it (the lock outlives nothing here: held)
    try:
        start = time.monotonic()
        with pytest.raises(BadAnswerError, match=r"still holds the file's lock after 0.5 s"):
            read_hidden_states(path, IDS, LAYERS, HIDDEN, lock_timeout=0.5)
        assert time.monotonic() - start < 5  # before the fix: blocked forever in flock(LOCK_SH)
    finally:
        os.close(fd)


def test_a_sigterm_ends_the_wait_for_the_engine(tiny, tmp_path):
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    storage = tmp_path / "hs"
    with _served(tiny, storage) as server:
        server.delay = 3.0  # a stalled server (longer than the wait the test allows)
        feed = _feed(tiny, tmp_path, [server.url], storage)
        stream = test_engine_stream._stream(tiny, feed, test_engine_stream._examples(2), prefetch=0)
        flag = threading.Event()
        stream.stop_requested = flag.is_set
        stream.plan([[0, 1]])
        threading.Timer(0.5, flag.set).start()
        start = time.monotonic()
        try:
            with pytest.raises(SIGTERMException):
                stream.take([0, 1])
            assert time.monotonic() - start < 5
        finally:
            server.stop()
            feed.close()


# ------------------------------------------------------------------------------------------------- restarts
class _Launched:
    """Stands in for `targets.server.VLLMServer` in launch mode: a fake hidden-states server that takes `boot` seconds
    to start and dies (its process exits, its port closes) at the request after its `lifetime`-th (exactly
    `lifetime` answers per process, whatever the load)."""

    made: list = []
    states = storage = None
    boot, lifetime = 0.3, 6

    def __init__(self, model, **kwargs):
        self.kwargs, self.fake, self.proc, self.port, self.log_path = kwargs, None, None, None, kwargs.get("log_path")
        type(self).made.append(self)

    def start(self):
        time.sleep(self.boot)  # requests sent meanwhile are refused, as by a server still starting
        self.fake = FakeHiddenStatesServer(type(self).states, type(self).storage, port=self.port or 0)
        self.base_url = self.fake.url
        fake, count = self.fake, itertools.count(1)
        fake.dies_at = lambda request_id: next(count) > self.lifetime
        self.proc = SimpleNamespace(poll=lambda: 1 if fake.dead else None, returncode=1)
        return self

    def stop(self):
        if self.fake is not None:
            self.fake.stop()
        self.proc = None


def test_a_launched_server_is_restarted_as_often_as_configured(tiny, tmp_path, monkeypatch, caplog):
    from eagle3_zoo.targets import deployment

    storage = tmp_path / "hs"
    _Launched.made, _Launched.states, _Launched.storage = [], tiny_states(copy.deepcopy(tiny[2]), AUX), storage
    monkeypatch.setattr(deployment, "VLLMServer", _Launched)
    monkeypatch.setattr(deployment, "engine_build", lambda python=None: "cpu")  # a CPU build
    recipe = _recipe(tiny, tmp_path, mode="launch", hidden_states_dir=str(storage), max_restarts=3, retries=1,
                     concurrency=4)
    feed = EngineFeed(EngineDeployment(recipe, AUX, 4), "e3ztestr0", 2**30, concurrency=4,
                      hidden_size=tiny[2].config.hidden_size).start()
    server = feed.deployment.servers[0]
    server.client.backoff = 0.01
    try:  # 24 requests, 4 in flight: the server dies after 6 answers, 3 times (restarts 3); all are answered
        futures = [feed.submit(IDS[: 2 + i % 4], f"t{i}") for i in range(24)]
        paths = [f.result() for f in futures]
        assert len(paths) == 24 and server.restarts == 3  # before the fix: EngineFeedError after the first restart
        futures = [feed.submit(IDS, f"u{i}") for i in range(8)]  # it dies a 4th time: restarts are spent
        with pytest.raises(EngineFeedError, match=rf"restarts of launched servers that died: {server.url} 3 "
                                                  r"\(engine.max_restarts = 3 each\)"):
            [f.result() for f in futures]
    finally:
        feed.close()
    assert "restarting it (3 of 3" in caplog.text and "restarting it (4 of" not in caplog.text


# ---------------------------------------------------------------------------------------------- the engine key
def test_the_engine_key_is_sent_by_the_feed_and_given_to_launched_servers_by_name(tiny, tmp_path, monkeypatch):
    from eagle3_zoo.targets import deployment

    monkeypatch.setenv("E3Z_TEST_ENGINE_KEY", "sk-engine-0123456789")
    storage = tmp_path / "hs"
    with _served(tiny, storage, api_key="sk-engine-0123456789") as server:
        with pytest.raises(ServerError, match="HTTP 401"):  # no key: refused (nothing sent one before the fix)
            _feed(tiny, tmp_path, [server.url], storage)
        feed = _feed(tiny, tmp_path, [server.url], storage, api_key_env="E3Z_TEST_ENGINE_KEY")
        try:
            feed.read(feed.submit(IDS, "t2").result(), IDS)
        finally:
            feed.close()
        assert server.authorizations[-1] == "Bearer sk-engine-0123456789"
    _Launched.made, _Launched.states, _Launched.storage = [], tiny_states(copy.deepcopy(tiny[2]), AUX), storage
    monkeypatch.setattr(deployment, "VLLMServer", _Launched)
    monkeypatch.setattr(deployment, "engine_build", lambda python=None: "cpu")  # a CPU build
    recipe = _recipe(tiny, tmp_path, mode="launch", hidden_states_dir=str(storage),
                     api_key_env="E3Z_TEST_ENGINE_KEY")
    with EngineDeployment(recipe, AUX, 4) as d:
        kw = _Launched.made[0].kwargs
        assert kw["env"]["VLLM_API_KEY"] == "sk-engine-0123456789"  # in its environment: vLLM requires the key
        assert "sk-engine" not in " ".join(kw["extra_args"]) and d.servers[0].client.api_key_env == \
            "E3Z_TEST_ENGINE_KEY"
    monkeypatch.delenv("E3Z_TEST_ENGINE_KEY")
    with pytest.raises(ValueError, match="E3Z_TEST_ENGINE_KEY, which is not set"):
        EngineDeployment(recipe, AUX, 4).start()


# ------------------------------------------------------------------------------------------------------- serve
SERVE = ["serve", "recipes/smollm2_135m.yaml", "--print-command", "engine.hidden_states_dir=/shared/hs",
         "engine.platform=cpu"]


@pytest.mark.parametrize("args, words", [
    (["--port", "-1"], "--port -1: expected a TCP port in 1-65535"),
    (["--port", "99999"], "--port 99999: expected a TCP port in 1-65535"),
    (["--port", "0"], "--port 0: expected a TCP port in 1-65535"),
    (["--host", ""], "--host '': expected an interface address"),
    (["--host", "a b"], "--host 'a b': expected an interface address"),
    (["--host", "0.0.0.0"], "opens the engine to the network without an API key"),
    (["--host", "10.0.0.5"], "opens the engine to the network without an API key")])
def test_serve_refuses_an_address_vllm_cannot_use_or_an_open_bind_without_a_key(capsys, args, words):
    assert main([*SERVE, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: serve: ") and words in err and len(err.splitlines()) == 1, err


def test_serve_binds_loopback_by_default_and_names_the_key_never_its_value(capsys, monkeypatch):
    monkeypatch.setenv("E3Z_TEST_ENGINE_KEY", "sk-engine-0123456789")
    assert main(SERVE) == 0
    assert "--host 127.0.0.1 --port 8000" in capsys.readouterr().out
    assert main([*SERVE, "--host", "0.0.0.0", "--no-api-key"]) == 0  # said explicitly
    assert "--host 0.0.0.0" in capsys.readouterr().out
    assert main([*SERVE, "--host", "0.0.0.0", "engine.api_key_env=E3Z_TEST_ENGINE_KEY"]) == 0
    out = capsys.readouterr().out
    assert 'VLLM_API_KEY="$E3Z_TEST_ENGINE_KEY"' in out and "sk-engine" not in out and "--api-key" not in out


def test_serve_without_a_hidden_states_dir_says_where_to_set_it(capsys):
    assert main(["serve", "recipes/smollm2_135m.yaml", "--print-command", "engine.platform=cpu"]) == 2
    err = capsys.readouterr().err
    assert "the recipe has no engine.hidden_states_dir" in err and "engine.hidden_states_dir=/shared/hs" in err

