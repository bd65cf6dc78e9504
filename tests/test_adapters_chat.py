"""Assistant loss masks for each family's real chat template (tiny offline tokenizers; SmolLM2's real GGUF one)."""

import sys

import pytest

from eagle3_zoo.adapters import TemplateMappingError, available_adapters, get_adapter, load_embedded_tokenizer
from eagle3_zoo.chat import formats as chat_module
from eagle3_zoo.chat.formats import ChatFormat, build_chat_example, load_chat_format

SYSTEM = "You are a terse geography tutor."
# 3 turns; the last reply has multi-byte characters that byte-level BPE splits across tokens
CONVERSATION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome, of course."},
    {"role": "user", "content": "Say goodbye in French."},
    {"role": "assistant", "content": "Au revoir! À bientôt 🙂"},
]
REPLIES = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
# (adapter, tokenizer source, end-of-turn token)
CASES = {
    "llama3": ("llama", "tiny", "<|eot_id|>"),
    "qwen2.5": ("qwen2", "tiny", "<|im_end|>"),
    "deepseek_v3": ("deepseek_v3", "tiny", "<｜end▁of▁sentence｜>"),
    "smollm2": ("llama", "gguf", "<|im_end|>"),
}


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return load_embedded_tokenizer()  # the real tokenizer, read from the embedded GGUF (or the converted cache)


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    family, source, eot = CASES[request.param]
    adapter = get_adapter(family)
    if source == "gguf":
        tokenizer = request.getfixturevalue("smollm2_tokenizer")
    else:
        tokenizer = adapter.tiny_tokenizer()
    return adapter, tokenizer, eot


def _supervised_runs(ids, mask):
    runs, current = [], []
    for token, supervised in zip(ids, mask):
        if supervised:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def _encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _expected_mask(tokenizer, ids, replies, eot):
    """Independent oracle: walk the ids and mark each reply's own tokenisation + the end-of-turn id where it occurs."""
    eot_id = tokenizer.convert_tokens_to_ids(eot)
    expected, pos = [0] * len(ids), 0
    for reply in replies:
        run = _encode(tokenizer, reply) + [eot_id]
        while ids[pos : pos + len(run)] != run:
            pos += 1
            assert pos < len(ids), f"reply {reply!r} not found as its own tokens"
        expected[pos : pos + len(run)] = [1] * len(run)
        pos += len(run)
    return expected


def test_loss_mask_is_exactly_assistant_content_and_end_of_turn(case):
    adapter, tokenizer, eot = case
    assert adapter.chat_format(tokenizer).end_of_turn == eot
    example = adapter.build_example(tokenizer, CONVERSATION, max_length=4096)
    ids, mask = example["input_ids"].tolist(), example["loss_mask"].tolist()
    assert len(ids) == len(mask) and set(mask) <= {0, 1}
    assert ids == tokenizer.apply_chat_template(CONVERSATION, tokenize=True)["input_ids"]
    assert mask == _expected_mask(tokenizer, ids, REPLIES, eot)  # token by token
    assert [tokenizer.decode(run) for run in _supervised_runs(ids, mask)] == [r + eot for r in REPLIES]
    unsupervised = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    assert SYSTEM in unsupervised and "What is the capital of France?" in unsupervised
    assert not any(reply in unsupervised for reply in REPLIES)


def test_default_system_prompt_and_system_prompt_argument(case):
    adapter, tokenizer, eot = case
    no_system = CONVERSATION[1:]
    base = adapter.build_example(tokenizer, no_system, max_length=4096)
    ids, mask = base["input_ids"].tolist(), base["loss_mask"].tolist()
    assert mask == _expected_mask(tokenizer, ids, REPLIES, eot)
    if adapter.chat_format(tokenizer).name == "chatml-qwen2.5":
        assert "You are Qwen, created by Alibaba Cloud. You are a helpful assistant." in tokenizer.decode(ids)
    with_arg = adapter.build_example(tokenizer, no_system, max_length=4096, system_prompt=SYSTEM)
    full = adapter.build_example(tokenizer, CONVERSATION, max_length=4096)
    assert with_arg["input_ids"].tolist() == full["input_ids"].tolist()
    # an explicit system message in the data wins over the argument
    kept = adapter.build_example(tokenizer, CONVERSATION, max_length=4096, system_prompt="ignored")
    assert kept["input_ids"].tolist() == full["input_ids"].tolist()


def test_empty_assistant_turn_is_rendered_but_not_supervised(case):
    adapter, tokenizer, eot = case
    messages = [dict(m) for m in CONVERSATION]
    messages[4]["content"] = ""  # "Rome, of course." -> empty reply
    example = adapter.build_example(tokenizer, messages, max_length=4096)
    ids, mask = example["input_ids"].tolist(), example["loss_mask"].tolist()
    assert ids == tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]
    assert mask == _expected_mask(tokenizer, ids, [REPLIES[0], REPLIES[2]], eot)
    assert len(_supervised_runs(ids, mask)) == 2


def test_truncation_keeps_a_consistent_prefix(case):
    adapter, tokenizer, _ = case
    full = adapter.build_example(tokenizer, CONVERSATION, max_length=4096)
    first_supervised = full["loss_mask"].tolist().index(1)
    for max_length in (1, first_supervised + 3, len(full["input_ids"]) - 1):
        short = adapter.build_example(tokenizer, CONVERSATION, max_length=max_length)
        assert len(short["input_ids"]) == len(short["loss_mask"]) == max_length
        assert short["input_ids"].tolist() == full["input_ids"][:max_length].tolist()
        assert short["loss_mask"].tolist() == full["loss_mask"][:max_length].tolist()
    with pytest.raises(ValueError, match="max_length"):
        adapter.build_example(tokenizer, CONVERSATION, max_length=0)


def test_llama3_template_trims_replies_and_the_mask_follows():
    adapter = get_adapter("llama")
    tokenizer = adapter.tiny_tokenizer()
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  Hello there.\n"}]
    example = adapter.build_example(tokenizer, messages, max_length=256)
    runs = _supervised_runs(example["input_ids"].tolist(), example["loss_mask"].tolist())
    assert [tokenizer.decode(r) for r in runs] == ["Hello there.<|eot_id|>"]


def test_tokenizer_without_template_uses_the_familys_template():
    adapter = get_adapter("qwen2")
    tokenizer = adapter.tiny_tokenizer()
    reference = adapter.build_example(tokenizer, CONVERSATION, max_length=4096)
    tokenizer.chat_template = None
    example = adapter.build_example(tokenizer, CONVERSATION, max_length=4096)
    assert example["input_ids"].tolist() == reference["input_ids"].tolist()
    assert example["loss_mask"].tolist() == reference["loss_mask"].tolist()


def test_smollm2_gguf_tokenizer_carries_the_real_chatml_template(smollm2_tokenizer):
    assert smollm2_tokenizer.chat_template == load_chat_format("chatml-smollm2").template
    assert len(smollm2_tokenizer) == 49152
    assert get_adapter("llama").chat_format(smollm2_tokenizer).name == "chatml-smollm2"


def test_unmappable_templates_give_clear_errors():
    tokenizer = get_adapter("qwen2").tiny_tokenizer()
    # rewrites earlier turns when more follow (as reasoning templates that drop old thoughts): not prefix-stable, but
    # each message's text still lands in order, so it is mapped by where the texts render
    counting = ChatFormat(
        "counting",
        "{{ messages | length }} turns:{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        "<|im_end|>",
    )
    bare = _without_template(tokenizer)
    example = build_chat_example(bare, CONVERSATION, 4096, counting)
    ids, mask = example["input_ids"].tolist(), example["loss_mask"].tolist()
    assert mask == _expected_mask(bare, ids, REPLIES, "<|im_end|>")
    # renders the conversation newest first: texts out of order, no turn can be delimited
    reversed_ = ChatFormat(
        "reversed",
        "{% for m in messages | reverse %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        "<|im_end|>",
    )
    with pytest.raises(TemplateMappingError, match="out of order"):
        build_chat_example(bare, CONVERSATION, 4096, reversed_)
    # closes assistant turns without the declared end-of-turn token
    no_eot = ChatFormat(
        "no-eot",
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}",
        "<|im_end|>",
    )
    with pytest.raises(TemplateMappingError, match="does not contain the end-of-turn token"):
        build_chat_example(bare, CONVERSATION, 4096, no_eot)
    qwen = get_adapter("qwen2")
    with pytest.raises(TemplateMappingError, match="leading assistant turn"):
        qwen.build_example(tokenizer, [{"role": "assistant", "content": "Hi"}], max_length=64)


def test_bad_messages_and_unknown_templates_are_rejected():
    adapter = get_adapter("deepseek_v3")
    tokenizer = adapter.tiny_tokenizer()
    with pytest.raises(ValueError, match="message 1: role 'gpt'"):
        adapter.build_example(tokenizer, [{"role": "user", "content": "q"}, {"role": "gpt", "content": "a"}], 64)
    with pytest.raises(ValueError, match="message 0 \\(user\\): content must be a str"):
        adapter.build_example(tokenizer, [{"role": "user", "content": None}], 64)
    tokenizer.chat_template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}"
    with pytest.raises(TemplateMappingError, match="declare a ChatFormat"):
        adapter.build_example(tokenizer, CONVERSATION, 64)


def _without_template(tokenizer):
    tokenizer = type(tokenizer)(tokenizer_object=tokenizer.backend_tokenizer, eos_token=tokenizer.eos_token)
    tokenizer.chat_template = None
    return tokenizer


@pytest.mark.parametrize("family", available_adapters())
def test_every_family_declares_shipped_chat_formats_with_source_and_tokenizer(family):
    formats = get_adapter(family).chat_formats
    assert formats, f"{family} declares no chat format"
    for fmt in formats:
        assert fmt.source and (fmt.signature or fmt.end_of_turn) in fmt.template, fmt.name
    assert formats[0].tokenizer is not None and formats[0].end_of_turn in formats[0].tokenizer.special_tokens


@pytest.fixture
def bad_format(tmp_path, monkeypatch):
    """Write ``bad.yaml`` (+ a template) into a throwaway resource package and load it as chat format ``bad``."""
    pkg = tmp_path / "fakepkg"
    (pkg / "chat_formats").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "chat_formats" / "bad.jinja").write_text("{{ messages }}")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fakepkg", raising=False)  # another test's

    def load(text):
        monkeypatch.setattr(chat_module, "CHAT_FORMATS_PACKAGE", "fakepkg")
        (pkg / "chat_formats" / "bad.yaml").write_text(text)
        load_chat_format.cache_clear()
        return load_chat_format("bad")

    yield load
    load_chat_format.cache_clear()


def test_chat_format_resource_errors_name_the_file_and_what_is_valid(bad_format):
    with pytest.raises(ValueError, match=r"no chat format 'nope' .*shipped: .*chatml-qwen2.5"):
        load_chat_format("nope")
    with pytest.raises(ValueError, match=r"bad.yaml: src: unknown key; did you mean 'source'\?"):
        bad_format("name: bad\nend_of_turn: '</s>'\nsrc: typo\n")


BAD_FORMATS = {  # bad.yaml after "name: bad\nend_of_turn: '</s>'\n" -> the one problem it has
    "feature": ("features: [tools, tool]",
                "features[1] = 'tool': expected one of thinking, tools; did you mean 'tools'?"),
    "no_eos": ("tokenizer: {special_tokens: ['</s>']}",
               "tokenizer.eos_token: required key missing (expected a string)"),
    "thinking_only": ("features: [thinking]",
                      "reasoning: required with the 'thinking' feature (field, start, end)"),
    "reasoning_only": ("reasoning: {field: thinking, start: <t>, end: </t>}",
                       "features: needs 'thinking': the file declares a reasoning mapping"),
    "expected_key": ("expected: {turns: '{reply}</s>'}", "expected.turns: unknown key; did you mean 'expected.turn'?"),
    "empty_end": ("turn_ends: ['</s>', '']", "turn_ends = ('</s>', ''): tokens must not be empty strings"),
}


@pytest.mark.parametrize("case", BAD_FORMATS)
def test_chat_format_file_problem_names_the_file_and_key(bad_format, tmp_path, case):
    text, problem = BAD_FORMATS[case]
    with pytest.raises(chat_module.ChatFormatError) as err:
        bad_format(f"name: bad\nend_of_turn: '</s>'\n{text}\n")
    assert [str(p) for p in err.value.problems] == [f"{tmp_path}/fakepkg/chat_formats/bad.yaml: {problem}"]
    assert str(err.value).startswith("invalid chat format (1 problem):\n  - ")


def test_chat_format_file_problems_are_raised_at_once(bad_format):
    with pytest.raises(ValueError) as err:  # ChatFormatError stays a ValueError for callers
        bad_format("name: good\nend_of_turn: 3\nfeatures: [thinking, tool]\ntokenizer: {special_tokens: [x]}\n"
                   "reasoning: {field: f, start: a, end: b, ends: c}\nthinking_off: [enable_thinking]\n")
    assert [(p.key, p.source.endswith("bad.yaml")) for p in err.value.problems] == [
        ("end_of_turn", True), ("features[1]", True), ("tokenizer.eos_token", True), ("reasoning.ends", True),
        ("thinking_off", True), ("name", True)]
    assert "reasoning.ends: unknown key; did you mean 'reasoning.end'?" in str(err.value)
    assert "name = 'good': must be the file's name, bad" in str(err.value)


def test_chat_format_file_round_trips_every_field(bad_format):
    fmt = bad_format("name: bad\nend_of_turn: '</s>'\nsource: here\nturn_ends: ['</s>', '<e>']\nsignature: sig\n"
                     "features: [thinking, tools]\nreasoning: {field: thinking, start: <t>, end: </t>}\n"
                     "thinking_off: {think: false}\ntokenizer: {special_tokens: ['</s>', '<t>'], eos_token: '</s>'}\n"
                     "expected: {turn: '{reply}</s>', tool_call: null}\n")
    assert fmt == ChatFormat("bad", "{{ messages }}", "</s>", source="here", turn_ends=("</s>", "<e>"), signature="sig",
                             features=("thinking", "tools"),
                             reasoning=chat_module.ReasoningFormat("thinking", "<t>", "</t>"),
                             thinking_off={"think": False}, expected={"turn": "{reply}</s>"},
                             tokenizer=chat_module.TinyTokenizerSpec(("</s>", "<t>"), "</s>"))


# ---------------------------------------------------------------------------------------------------------------------
# Every chat format of every registered family (plus every shipped format with tokenizer specials, so formats whose
# adapter is not registered yet are covered too): multi-turn, thinking and tool turns, token by token.


def _family_formats():
    from importlib import resources

    names = {f.name for family in available_adapters() for f in get_adapter(family).chat_formats}
    folder = resources.files(chat_module.CHAT_FORMATS_PACKAGE).joinpath("chat_formats")
    names |= {p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml")}
    return sorted(n for n in names if load_chat_format(n).tokenizer is not None)


FORMATS = _family_formats()
CALL = {"id": "abcDEF123", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CALL_JSON = '{"city": "Paris"}'
TOOL_CONVERSATION = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning": "I should call the tool.", "tool_calls": [CALL]},
    {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "abcDEF123"},
    {"role": "assistant", "content": "Sunny and 21 C.", "reasoning": "The tool says sunny."},
]
THOUGHTS = ["France: Paris.", "Italy: Rome.", "French farewell."]


def _thinking_conversation():
    out, k = [], 0
    for m in CONVERSATION:
        out.append(dict(m))
        if m["role"] == "assistant":
            out[-1]["reasoning"] = THOUGHTS[k]
            k += 1
    return out


def generated(fmt, reply, reasoning, last, thinking):
    """What `fmt`'s target generates for one assistant message: the hand-written `expected` texts of its resource
    file (independent of the mapping code)."""
    e = fmt.expected
    if last and thinking and "last_turn_thinking" in e:
        empty = e.get("last_turn_thinking_empty", e.get("last_turn", e["turn"]))
        text = e["last_turn_thinking"] if reasoning else empty
    else:
        text = e.get("last_turn", e["turn"]) if last else e["turn"]
    return text.format(reply=reply, reasoning=reasoning)


def generated_call(fmt, reasoning=""):
    """The tool-call turn of TOOL_CONVERSATION as `fmt`'s target generates it."""
    return fmt.expected["tool_call"].format(name="get_weather", arguments=CALL_JSON, call_id="abcDEF123",
                                            reasoning=reasoning)


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module", params=FORMATS)
def fmt_tokenizer(request):
    from eagle3_zoo.chat.tiny_tokenizer import build_tiny_tokenizer

    fmt = load_chat_format(request.param)
    return fmt, build_tiny_tokenizer(fmt.tokenizer, fmt.template)


def _runs_oracle(tokenizer, ids, runs):
    """Independent oracle: each expected run's own tokenisation, found in order in the ids."""
    expected, pos = [0] * len(ids), 0
    for run in runs:
        run_ids = _encode(tokenizer, run)
        while ids[pos : pos + len(run_ids)] != run_ids:
            pos += 1
            assert pos < len(ids), f"expected generated text {run!r} not found as its own tokens"
        expected[pos : pos + len(run_ids)] = [1] * len(run_ids)
        pos += len(run_ids)
    return expected


def _check(fmt, tokenizer, messages, runs, kwargs=None, prompts=(), reference=None, tools=None):
    example = build_chat_example(tokenizer, messages, 4096, fmt, template_kwargs=kwargs, tools=tools)
    ids, mask = example["input_ids"].tolist(), example["loss_mask"].tolist()
    reference = reference or messages
    if fmt.reasoning:  # the template reads reasoning under its own field (transformers >= 5.2x maps `reasoning` too)
        reference = [{(fmt.reasoning.field if k == "reasoning" else k): v for k, v in m.items()} for m in reference]
    rendered = tokenizer.apply_chat_template(reference, tokenize=True, tools=tools, **(kwargs or {}))["input_ids"]
    assert ids == rendered
    assert mask == _runs_oracle(tokenizer, ids, runs)  # token by token
    assert [tokenizer.decode(r) for r in _supervised_runs(ids, mask)] == runs
    unsupervised = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    for text in prompts:
        assert text in unsupervised
    return ids, mask


def test_every_shipped_format_has_a_hand_written_expectation():
    for name in FORMATS:
        e = load_chat_format(name).expected
        assert "turn" in e, f"{name}.yaml: write what the target generates into 'expected' (see chat.EXPECTED_KEYS)"
        fmt = load_chat_format(name)
        assert ("tools" in fmt.features) == ("tool_call" in e), name
        assert ("thinking" in fmt.features) == ("last_turn_thinking" in e), name


def test_multi_turn_mask_every_format(fmt_tokenizer):
    fmt, tokenizer = fmt_tokenizer
    last = len(REPLIES) - 1
    runs = [generated(fmt, r, "", k == last, "thinking" in fmt.features) for k, r in enumerate(REPLIES)]
    _check(fmt, tokenizer, CONVERSATION, runs, prompts=[SYSTEM, "What is the capital of France?", "And of Italy?"])


def test_thinking_mask_keeps_the_last_turns_reasoning(fmt_tokenizer):
    fmt, tokenizer = fmt_tokenizer
    if "thinking" not in fmt.features:
        pytest.skip(f"{fmt.name} has no reasoning")
    last = len(REPLIES) - 1
    runs = [generated(fmt, r, THOUGHTS[k], k == last, True) for k, r in enumerate(REPLIES)]
    ids, _ = _check(fmt, tokenizer, _thinking_conversation(), runs)
    rendered = tokenizer.decode(ids)
    assert THOUGHTS[-1] in rendered and not any(t in rendered for t in THOUGHTS[:-1])  # earlier thinking dropped


def test_thinking_off_supervises_no_reasoning_and_not_the_prompts_empty_block(fmt_tokenizer):
    fmt, tokenizer = fmt_tokenizer
    if not fmt.thinking_off:
        pytest.skip(f"{fmt.name} cannot turn thinking off")
    runs = [generated(fmt, r, "", k == len(REPLIES) - 1, False) for k, r in enumerate(REPLIES)]
    ids, mask = _check(fmt, tokenizer, _thinking_conversation(), runs, kwargs=dict(fmt.thinking_off),
                       reference=CONVERSATION)
    rendered = tokenizer.decode(ids)
    assert not any(t in rendered for t in THOUGHTS)  # reasoning in the data is dropped: the target did not think
    if fmt.name == "qwen3":  # the empty block is in the prompt of the last turn, unsupervised
        empty = _encode(tokenizer, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
        at = next(i for i in range(len(ids)) if ids[i : i + len(empty)] == empty)
        assert not any(mask[at : at + len(empty)]) and mask[at + len(empty)] == 1


def test_tool_turns_supervise_calls_not_results(fmt_tokenizer):
    fmt, tokenizer = fmt_tokenizer
    if "tools" not in fmt.features:
        pytest.skip(f"{fmt.name} declares no tool turns")
    thinking = "thinking" in fmt.features
    runs = [generated_call(fmt, "I should call the tool." if thinking else ""),
            generated(fmt, "Sunny and 21 C.", "The tool says sunny." if thinking else "", True, thinking)]
    _check(fmt, tokenizer, TOOL_CONVERSATION, runs, prompts=["What is the weather in Paris?", "sunny, 21 C"])


def test_prefix_diff_and_region_mapping_agree_on_stable_turns(fmt_tokenizer):
    fmt, tokenizer = fmt_tokenizer
    renderer = chat_module._Renderer(tokenizer, fmt.template, None)
    messages = chat_module._validated(CONVERSATION, None, fmt, None)
    mapper = chat_module._TurnMapper(renderer, messages, fmt)
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            prompt = renderer.render(messages[:i], add_generation_prompt=True)
            assert mapper._span_by_region(i, prompt) == mapper.span(i), (fmt.name, i)


def test_reasoning_split_of_generated_replies():
    qwen3, harmony = load_chat_format("qwen3").reasoning, load_chat_format("harmony").reasoning
    assert qwen3.split("<think>\nhmm\n</think>\n\nParis.") == ("hmm", "Paris.")
    assert qwen3.split("Paris.") == ("", "Paris.")
    assert qwen3.split("<think>\ncut off mid-thou") == ("cut off mid-thou", "")
    reply = "<|channel|>analysis<|message|>hmm<|end|><|start|>assistant<|channel|>final<|message|>Paris."
    assert harmony.split(reply) == ("hmm", "Paris.")
    assert harmony.split("<|channel|>final<|message|>Paris.") == ("", "Paris.")


def test_tool_definitions_reach_the_template_and_earlier_turns_still_map(fmt_tokenizer):
    """A greeting turn before the tool turns: Mistral 3.2 then moves [AVAILABLE_TOOLS] past it (region mapping with
    no generation prompt); the others put the definitions in the system or first user turn."""
    fmt, tokenizer = fmt_tokenizer
    if "tools" not in fmt.features:
        pytest.skip(f"{fmt.name} declares no tool turns")
    thinking = "thinking" in fmt.features
    messages = [{"role": "user", "content": "Hello, how are you today?"},
                {"role": "assistant", "content": "Hello! Thanks."}, *TOOL_CONVERSATION]
    runs = [generated(fmt, "Hello! Thanks.", "", False, thinking),
            generated_call(fmt, "I should call the tool." if thinking else ""),
            generated(fmt, "Sunny and 21 C.", "The tool says sunny." if thinking else "", True, thinking)]
    ids, _ = _check(fmt, tokenizer, messages, runs, tools=TOOLS,
                    prompts=["Current weather of a city.", "Hello, how are you today?", "sunny, 21 C"])
    without = build_chat_example(tokenizer, messages, 4096, fmt)["input_ids"].tolist()
    assert "Current weather of a city." not in tokenizer.decode(without) and len(without) < len(ids)


def test_formats_without_tool_turns_refuse_tool_conversations(fmt_tokenizer):
    """No silent mask for a call the template drops (DeepSeek-V3 needs content=None, which transformers removes;
    Mistral 2501 has no tool calls; Gemma 3 no tool role)."""
    fmt, tokenizer = fmt_tokenizer
    if "tools" in fmt.features:
        pytest.skip(f"{fmt.name} renders tool turns")
    with pytest.raises(TemplateMappingError, match="renders none of the tool calls|failed to render"):
        build_chat_example(tokenizer, TOOL_CONVERSATION, 4096, fmt)


def test_deepseek_v3_drops_tool_calls_so_they_are_refused():
    adapter = get_adapter("deepseek_v3")
    with pytest.raises(TemplateMappingError, match="'deepseek_v3' renders none of the tool calls of assistant turn 1"):
        adapter.build_example(adapter.tiny_tokenizer(), TOOL_CONVERSATION, 4096)


def test_llama3_tool_rules_single_call_ipython_and_builtin_tools():
    fmt = load_chat_format("llama3")
    tokenizer = get_adapter("llama").tiny_tokenizer()
    two_calls = [dict(m) for m in TOOL_CONVERSATION]
    two_calls[1]["tool_calls"] = [CALL, CALL]
    with pytest.raises(TemplateMappingError, match="only supports single tool-calls"):
        build_chat_example(tokenizer, two_calls, 4096, fmt)
    # the tool result is an ipython turn; with built-in tools (ipython mode) a call ends with <|eom_id|>
    search = {"function": {"name": "brave_search", "arguments": {"query": "weather Paris"}}}
    messages = [TOOL_CONVERSATION[0], {"role": "assistant", "content": None, "tool_calls": [search]},
                {"role": "tool", "content": "sunny"},
                {"role": "assistant", "content": "Sunny."}]
    kwargs = {"builtin_tools": ["brave_search"]}
    _check(fmt, tokenizer, messages, ['<|python_tag|>brave_search.call(query="weather Paris")<|eom_id|>',
                                      "Sunny.<|eot_id|>"],
           kwargs=kwargs,
           prompts=["Environment: ipython\nTools: brave_search", "<|start_header_id|>ipython<|end_header_id|>"])


def test_mistral_tokenizers_resolve_to_their_own_template():
    adapter = get_adapter("mistral")
    assert [f.name for f in adapter.chat_formats] == ["mistral-small-2501", "mistral-small"]
    tokenizer = adapter.tiny_tokenizer()
    assert tokenizer.chat_template == load_chat_format("mistral-small-2501").template
    assert adapter.chat_format(tokenizer).name == "mistral-small-2501"
    tokenizer.chat_template = load_chat_format("mistral-small").template
    assert adapter.chat_format(tokenizer).name == "mistral-small"
    assert "You are Mistral Small 3" in load_chat_format("mistral-small-2501").template


def test_bad_tool_definitions_are_rejected():
    tokenizer = get_adapter("qwen3").tiny_tokenizer()
    fmt = load_chat_format("qwen3")
    for tools, match in [({"name": "f"}, "tools must be a list of function schemas, got dict"),
                         ([{"type": "function", "function": {"description": "x"}}], r"tools\[0\] needs a function")]:
        with pytest.raises(ValueError, match=match):
            build_chat_example(tokenizer, CONVERSATION, 4096, fmt, tools=tools)
    plain = build_chat_example(tokenizer, CONVERSATION, 4096, fmt)["input_ids"].tolist()
    assert build_chat_example(tokenizer, CONVERSATION, 4096, fmt, tools=[])["input_ids"].tolist() == plain
