"""The OpenAI request surface, unit level: every parameter vLLM's OpenAI server accepts maps onto
kvroute's engine ``SamplingParams`` and from there onto vLLM's ``SamplingParams`` exactly as vLLM's
own ``to_sampling_params`` maps the same body (built with vLLM's own classes); unknown fields and
what kvroute cannot honour are 400s naming the field; stop strings at the ingress follow vLLM's
detokenizer; ``n`` choices get vLLM's per-child seeds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from engines.base import EngineOutput, EngineRequest, RoutedRequest, SamplingParams, Usage
from router.api import ChatCompletionRequest, CompletionRequest, checked_token_ids
from router.api_errors import APIError, field_path, validation_error
from router.api_fields import MAX_JSON_DEPTH, bounded_nesting
from router.lifecycle import choice_requests
from router.openapi import json_body_schema
from router.responses import ResponseBuilder, check_stop_strings
from tests.support import FORGED_TRANSFER_PARAMS, nested_json

VOCAB = 512
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}

# Bodies that exercise every sampling parameter kvroute passes to vLLM.
BODIES: list[dict[str, Any]] = [
    {},
    {"temperature": 0.0, "seed": 7, "stop": "\n\n", "max_tokens": 9},
    {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "repetition_penalty": 1.1,
        "seed": -3,
        "stop": ["END", "##"],
        "stop_token_ids": [3, 4, 3],
        "include_stop_str_in_output": True,
        "ignore_eos": True,
        "min_tokens": 2,
        "logit_bias": {"17": 250.0, "18": -5.5},
        "allowed_token_ids": [17, 18, 19],
        "bad_words": ["foo", "bar"],
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "stream": True,
        "stream_interval": 4,
        "vllm_xargs": {"a": 1, "b": ["x", 2.5]},
    },
    {"response_format": {"type": "json_object"}},
    {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "t", "schema": {"type": "object"}, "strict": True},
        }
    },
    {"response_format": {"type": "text"}, "structured_outputs": {"choice": ["yes", "no"]}},
    {"structured_outputs": {"regex": "[ab]+", "disable_any_whitespace": True}},
]
CHAT_ONLY = [
    {"logprobs": True, "top_logprobs": 5},
    {"logprobs": True},
    {"logprobs": True, "logprob_token_ids": [5, 6]},
]
COMPLETION_ONLY = [{"logprobs": 3}, {"logprobs": 0}, {"logprobs": 2, "logprob_token_ids": [9]}]
COMPARED = [
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "logprob_token_ids",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "stream_interval",
    "structured_outputs",
    "extra_args",
    "n",
]


def _vllm_engine() -> Any:
    from engines.vllm_engine import VllmEngine

    return VllmEngine("unused-model-path", "unit")  # _sampling needs no running engine


def _ours(body: dict[str, Any], chat: bool, max_tokens: int) -> Any:
    model = ChatCompletionRequest if chat else CompletionRequest
    req = model.model_validate(body)
    req.refusals("vllm")
    request = EngineRequest("r", [1, 2, 3], req.sampling(max_tokens, VOCAB))
    return _vllm_engine()._sampling(request)


def _theirs(body: dict[str, Any], chat: bool, max_tokens: int) -> Any:
    if chat:
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionRequest as VllmChat,
        )

        return VllmChat.model_validate(body).to_sampling_params(max_tokens, {})
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest as VllmCompletion

    return VllmCompletion.model_validate(body).to_sampling_params(max_tokens, {})


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize("extra", range(len(BODIES) + 3))
def test_sampling_matches_vllms_own_openai_mapping(chat: bool, extra: int) -> None:
    pytest.importorskip("vllm")
    if extra < len(BODIES):
        fields = BODIES[extra]
    else:
        fields = (CHAT_ONLY if chat else COMPLETION_ONLY)[extra - len(BODIES)]
    body = {**(CHAT if chat else COMPLETION), **fields}
    ours, theirs = _ours(body, chat, 11), _theirs(body, chat, 11)
    for name in COMPARED:
        assert getattr(ours, name) == getattr(theirs, name), name


def test_defaults_stay_unset_for_the_engines_generation_config() -> None:
    """A body that sets no sampling knob leaves them None: the vLLM engine applies the model's
    generation config (as vLLM's server does), then OpenAI's defaults."""
    sp = ChatCompletionRequest.model_validate(CHAT).sampling(5, VOCAB)
    assert sp.temperature is sp.top_p is sp.top_k is sp.repetition_penalty is None
    from engines.vllm_engine import OPENAI_KNOB_DEFAULTS

    engine = _vllm_engine()
    assert engine.knob_defaults is None  # before start: OpenAI's defaults
    assert engine._sampling(EngineRequest("r", [1], sp)).temperature == 1.0
    # what start() sets: the model's generation config over OpenAI's defaults
    engine.knob_defaults = {**OPENAI_KNOB_DEFAULTS, "temperature": 0.6, "top_k": 20}
    vsp = engine._sampling(EngineRequest("r", [1], sp))
    assert (vsp.temperature, vsp.top_k, vsp.top_p) == (0.6, 20, 1.0)
    explicit = ChatCompletionRequest.model_validate({**CHAT, "temperature": 1.0}).sampling(5, VOCAB)
    assert engine._sampling(EngineRequest("r", [1], explicit)).temperature == 1.0


def test_free_form_json_bound_for_the_engine_may_nest_up_to_the_limit() -> None:
    deep = nested_json(MAX_JSON_DEPTH)
    kept = ChatCompletionRequest.model_validate({**CHAT, "structured_outputs": {"json": deep}})
    assert kept.structured_outputs is not None and kept.structured_outputs.json_ == deep
    assert bounded_nesting([[[]]]) == [[[]]]
    assert bounded_nesting("[" * 1000) == "[" * 1000  # a schema given as text is not read
    with pytest.raises(ValueError, match=f"nested deeper than {MAX_JSON_DEPTH} levels"):
        bounded_nesting(nested_json(MAX_JSON_DEPTH + 1))


def _field_error(body: dict[str, Any], chat: bool = True) -> str | None:
    """The ``param`` of the 400 a malformed body gets."""
    model = ChatCompletionRequest if chat else CompletionRequest
    with pytest.raises(ValidationError) as e:
        model.model_validate({**(CHAT if chat else COMPLETION), **body})
    err = validation_error(e.value, model)
    assert err.status == 400 and err.message.startswith(f"{err.param}: ")
    return err.param


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ({"functions": []}, "functions"),
        ({"store": True}, "store"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # needs stream=true
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"top_logprobs": 3}, "top_logprobs"),  # needs logprobs=true
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages.0.content",
        ),
        ({"messages": [{"role": "user", "content": "x", "audio": None}]}, "messages.0.audio"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"seed": 2**64}, "seed"),
        ({"cache_salt": "a/b"}, "cache_salt"),
        ({"temperature": float("nan")}, "temperature"),
        # pydantic's union-member tags are not part of the field's path ...
        ({"stop": 5}, "stop"),
        ({"tool_choice": 5}, "tool_choice"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ({"structured_outputs": {"json": 5}}, "structured_outputs.json"),
        # ... but dict keys that look like them are
        ({"vllm_xargs": {"Key": {}}}, "vllm_xargs.Key"),
        ({"vllm_xargs": {"list[str]": [{}]}}, "vllm_xargs.list[str]"),
        ({"vllm_xargs": {"K": [{}]}}, "vllm_xargs.K"),
        # free-form JSON bound for the engine, nested past what Ray can pickle on the way
        # transfer parameters are the router's: every key a client sends is an error naming it
        (
            {"kv_transfer_params": {"do_remote_prefill": True}},
            "kv_transfer_params.do_remote_prefill",
        ),
        ({"kv_transfer_params": {"kvroute": {"pin": True}}}, "kv_transfer_params.kvroute"),
        ({"kv_transfer_params": {"remote_host": "x"}}, "kv_transfer_params.remote_host"),
        ({"kv_transfer_params": nested_json(MAX_JSON_DEPTH + 1)}, "kv_transfer_params.a"),
        ({"kvroute_category": "a" * 33}, "kvroute_category"),
        ({"kvroute_category": "a b"}, "kvroute_category"),
        ({"structured_outputs": {"json": nested_json(600)}}, "structured_outputs.json"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": nested_json(MAX_JSON_DEPTH + 1)},
                }
            },
            "response_format.json_schema.schema",
        ),
    ],
)
def test_unknown_and_malformed_fields_are_errors_naming_them(body: dict, loc: str) -> None:
    assert _field_error(body) == loc


def test_client_kv_transfer_params_may_only_be_empty() -> None:
    """The request of the issue (a decode engine told to pull from a host the client chose, and
    a cached-token count it made up) is a 400 naming the key; empty or null passes."""
    forged = FORGED_TRANSFER_PARAMS
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({**CHAT, "kv_transfer_params": forged})
    err = validation_error(e.value, ChatCompletionRequest)
    assert err.param == "kv_transfer_params.do_remote_prefill"
    assert "set by the router only" in err.message
    for empty in ({}, None):
        ok = ChatCompletionRequest.model_validate({**CHAT, "kv_transfer_params": empty})
        assert not ok.kv_transfer_params


@pytest.mark.parametrize(
    "key", ["kv_transfer_params", "ec_transfer_params", "kv_cache_report_mode"]
)
def test_vllm_xargs_may_not_set_what_vllm_reads_from_extra_args(key: str) -> None:
    """vLLM's Request reads these keys of ``extra_args`` (``kv_cache_report_mode: full`` makes
    the engine re-publish every reused block as stored: an event storm on the cache-map bus)."""
    req = ChatCompletionRequest.model_validate({**CHAT, "vllm_xargs": {key: "full"}})
    with pytest.raises(APIError) as e:
        req.refusals("vllm")
    assert e.value.status == 400 and e.value.param == f"vllm_xargs.{key}"
    fine = ChatCompletionRequest.model_validate({**CHAT, "vllm_xargs": {"my_processor_arg": 1}})
    fine.refusals("vllm")


def test_completion_prompts_come_as_one_or_a_batch() -> None:
    """vLLM's forms: a text, token ids, a list of texts, a list of token-id lists."""
    one = CompletionRequest.model_validate({**COMPLETION, "prompt": "a"})
    assert one.prompts() == ["a"]
    batch = CompletionRequest.model_validate({**COMPLETION, "prompt": ["a", "b"]})
    assert batch.prompts() == ["a", "b"]
    ids = CompletionRequest.model_validate({**COMPLETION, "prompt": [[1, 2], [3]]})
    assert ids.prompts() == [[1, 2], [3]]
    assert _field_error({"prompt": ["a", ""]}, chat=False) == "prompt"
    assert _field_error({"prompt": [[1], []]}, chat=False) == "prompt"
    assert _field_error({"prompt": ["a"] * 65}, chat=False) == "prompt"


def test_every_error_location_drops_union_tags_and_keeps_keys() -> None:
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({**CHAT, "vllm_xargs": {"Key": [{}]}})
    locs = {field_path(ChatCompletionRequest, err["loc"]) for err in e.value.errors()}
    assert locs == {("vllm_xargs", "Key"), ("vllm_xargs", "Key", 0)}
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({**COMPLETION, "prompt": [[1, "a"]]})
    locs = {field_path(CompletionRequest, err["loc"]) for err in e.value.errors()}
    assert locs == {("prompt",), ("prompt", 0), ("prompt", 0, 1)}
    assert _field_error({"prompt": 5}, chat=False) == "prompt"


@pytest.mark.parametrize(
    "prompt", [[0, 5, 511], [[7, 3]], [2**32 + 1, 4], [2**40], [-1, 3], [[4, -2]]]
)
def test_token_id_prompts_are_checked_against_sign_and_vocabulary(prompt: list[Any]) -> None:
    """A negative id is a validation error naming ``prompt``; an id past the vocabulary (also
    one past 32 bits, which the fast uint32 path cannot hold) a 400 naming the largest."""
    flat = prompt[0] if isinstance(prompt[0], list) else prompt
    if min(flat) < 0:
        assert _field_error({"prompt": prompt}, chat=False) == "prompt"
        return
    req = CompletionRequest.model_validate({**COMPLETION, "prompt": prompt})
    assert req.prompts() == [flat]
    if max(flat) < VOCAB:
        assert checked_token_ids(flat, VOCAB, "prompt") == flat
        return
    with pytest.raises(APIError) as e:
        checked_token_ids(flat, VOCAB, "prompt")
    assert e.value.status == 400 and e.value.param == "prompt"
    assert f"token id {max(flat)} is outside the vocabulary" in str(e.value)


def _refusal(body: dict[str, Any], chat: bool = True, kind: str = "vllm") -> str | None:
    model = ChatCompletionRequest if chat else CompletionRequest
    req = model.model_validate({**(CHAT if chat else COMPLETION), **body})
    with pytest.raises(APIError) as e:
        req.refusals(kind)  # type: ignore[arg-type]
        req.sampling(16, VOCAB)
    assert e.value.status == 400
    return e.value.param


@pytest.mark.parametrize(
    ("body", "chat", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, True, "tools"),
        ({"tool_choice": "auto"}, True, "tool_choice"),
        ({"use_beam_search": True}, True, "use_beam_search"),
        ({"prompt_logprobs": 1}, False, "prompt_logprobs"),
        ({"echo": True}, False, "echo"),
        ({"echo": True}, True, "echo"),
        ({"suffix": "x"}, False, "suffix"),
        ({"chat_template": "{{ x }}"}, True, "chat_template"),
        ({"add_generation_prompt": False}, True, "add_generation_prompt"),
        ({"priority": 1}, True, "priority"),
        ({"n": 2, "temperature": 0}, True, "n"),
        ({"logit_bias": {"x": 1}}, True, "logit_bias"),
        ({"logit_bias": {"9999": 1}}, True, "logit_bias"),
        ({"stop_token_ids": [VOCAB]}, False, "stop_token_ids"),
        ({"allowed_token_ids": []}, False, "allowed_token_ids"),
        ({"min_tokens": 17}, False, "min_tokens"),
        ({"logprob_token_ids": [1]}, False, "logprob_token_ids"),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            True,
            "structured_outputs",
        ),
    ],
)
def test_what_kvroute_cannot_honour_is_a_400_naming_it(body: dict, chat: bool, param: str) -> None:
    assert _refusal(body, chat) == param


@pytest.mark.parametrize(
    ("body", "chat", "param"),
    [
        ({"logprobs": True}, True, "logprobs"),
        ({"logprobs": 0}, False, "logprobs"),
        ({"response_format": {"type": "json_object"}}, True, "response_format"),
        ({"structured_outputs": {"choice": ["a"]}}, False, "structured_outputs"),
        ({"logit_bias": {"3": 5}}, True, "logit_bias"),
        ({"allowed_token_ids": [3]}, False, "allowed_token_ids"),
        ({"bad_words": ["x"]}, True, "bad_words"),
        ({"skip_special_tokens": False}, True, "skip_special_tokens"),
        ({"vllm_xargs": {"a": 1}}, False, "vllm_xargs"),
    ],
)
def test_the_sim_engine_refuses_what_it_cannot_produce(body: dict, chat: bool, param: str) -> None:
    assert _refusal(body, chat, kind="sim") == param


def test_what_the_sim_engine_honours_or_has_no_distribution_for_passes() -> None:
    body = {
        **CHAT,
        "temperature": 0.3,
        "top_p": 0.5,
        "presence_penalty": 1,
        "seed": 4,
        "n": 3,
        "stop": ["x"],
        "stop_token_ids": [9],
        "min_tokens": 1,
        "ignore_eos": True,
        "response_format": {"type": "text"},
        "tool_choice": "none",
        "parallel_tool_calls": True,
        "user": "u",
        "session_id": "s",
        "request_id": "abc",
        "return_token_ids": True,
    }
    req = ChatCompletionRequest.model_validate(body)
    req.refusals("sim")
    sp = req.sampling(8, VOCAB)
    assert (sp.seed, sp.stop, sp.stop_token_ids, sp.min_tokens) == (4, ["x"], [9], 1)


def test_choices_get_vllms_child_ids_and_seeds() -> None:
    routed = RoutedRequest(EngineRequest("cmpl-1", [1, 2], SamplingParams(seed=100)), "p")
    assert choice_requests(routed, 1) == [routed]
    kids = choice_requests(routed, 3)
    assert [k.request.request_id for k in kids] == ["0_cmpl-1", "1_cmpl-1", "2_cmpl-1"]
    assert [k.request.sampling.seed for k in kids] == [100, 101, 102]
    assert len({id(k.request) for k in kids}) == 3  # the dispatcher stamps each on its own
    unseeded = RoutedRequest(EngineRequest("r", [1], SamplingParams()), "p")
    seeds = [k.request.sampling.seed for k in choice_requests(unseeded, 2)]
    assert seeds[0] is not None and seeds[1] == seeds[0] + 1


def test_request_bodies_are_documented_with_defs_inlined() -> None:
    schema = json_body_schema(ChatCompletionRequest)["requestBody"]["content"]
    body = schema["application/json"]["schema"]
    assert "$ref" not in str(body) and "$defs" not in body
    assert {"messages", "stop", "logprobs", "response_format", "n"} <= set(body["properties"])
    assert body["additionalProperties"] is False


# -- stop strings at the ingress (engines that return token ids only) ------------------------------


class _CharTokenizer:
    """Token id i decodes to chr(i) (ids >= 32); enough for IncrementalDetokenizer."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def _builder(body: dict[str, Any]) -> ResponseBuilder:
    req = CompletionRequest.model_validate({**COMPLETION, **body})
    return ResponseBuilder(req, False, _CharTokenizer(), "cmpl-x", 2)  # type: ignore[arg-type]


def _outs(text: str, per: int = 1) -> list[EngineOutput]:
    ids = [ord(c) for c in text]
    outs = [EngineOutput("r", ids[i : i + per]) for i in range(0, len(ids), per)]
    outs[-1].finished, outs[-1].finish_reason = True, "length"
    outs[-1].usage = Usage(2, len(ids), 0)
    return outs


@pytest.mark.parametrize("per", [1, 3])
def test_stop_strings_cut_the_text_like_vllm(per: int) -> None:
    b = _builder({"stop": ["lo w", "zz"]})
    streamed = ""
    for out in _outs("hello world, zz", per):
        for chunk in b.chunks(0, out, "i"):
            streamed += chunk["choices"][0]["text"]
        if b.choices[0].done:
            break
    c = b.choices[0]
    assert (c.text, streamed, c.finish_reason, c.stop_reason) == ("hel", "hel", "stop", "lo w")
    # tokens after the one completing the stop string are dropped, that one is kept
    assert c.token_ids == [ord(ch) for ch in "hello w"]
    inc = _builder({"stop": "lo", "include_stop_str_in_output": True})
    for out in _outs("hello world", per):
        inc.add(0, out, "i")
    assert inc.choices[0].text == "hello" and inc.choices[0].finish_reason == "stop"


def test_stop_strings_wait_for_min_tokens_and_stop_tokens_are_not_text() -> None:
    b = _builder({"stop": "ab", "min_tokens": 3})
    for out in _outs("abxab--"):
        b.add(0, out, "i")
    assert b.choices[0].text == "abx"
    t = _builder({})
    ids = [ord("a"), ord("!")]
    out = EngineOutput("r", ids, None, True, "stop", Usage(2, 2, 0), stop_reason=33)
    t.add(0, out, "i")
    assert (t.choices[0].text, t.choices[0].stop_reason) == ("a", 33)
    kept = _builder({"include_stop_str_in_output": True})
    kept.add(0, out, "i")
    assert kept.choices[0].text == "a!"


def test_streaming_holds_back_a_possible_stop_string_prefix() -> None:
    b = _builder({"stop": "xyz"})
    sent = [b.add(0, out, "i") for out in _outs("abcxy!")]
    assert sent == ["", "", "a", "b", "c", "xy!"]  # 2 characters held until they cannot match


@settings(max_examples=200, deadline=None)
@given(
    st.text("abc", max_size=12),
    st.integers(0, 12),
    st.lists(st.text("abc", min_size=1, max_size=3), min_size=1, max_size=3),
    st.booleans(),
)
def test_check_stop_strings_is_vllms(text: str, new: int, stops: list[str], include: bool) -> None:
    pytest.importorskip("vllm")
    from vllm.v1.engine.detokenizer import check_stop_strings as vllm_check

    new = min(new, len(text))
    assert check_stop_strings(text, new, stops, include) == vllm_check(text, new, stops, include)


def tiny_tokenizer_with_bos(path: Path) -> tuple[Any, int]:
    """The tiny model's tokenizer files copied to ``path``, its post-processor adding a BOS (as
    Llama's does to a prompt): the ``tokenizers.Tokenizer`` saved there, and the BOS id."""
    import shutil

    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    from engines.tiny_model import build_tiny_model

    for f in build_tiny_model().iterdir():
        if f.is_file() and f.suffix in (".json", ".jinja") and f.name != "kvroute-tiny.json":
            shutil.copy(f, path / f.name)
    hf = Tokenizer.from_file(str(path / "tokenizer.json"))
    bos = hf.token_to_id("<|bos|>")
    hf.post_processor = TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", bos)])
    hf.save(str(path / "tokenizer.json"))
    return hf, bos


def test_completion_prompts_get_special_tokens_as_vllm_adds_them(tmp_path) -> None:
    """vLLM's completions add the tokenizer's special tokens (a BOS for Llama's) unless
    ``add_special_tokens`` is false; chat leaves them to the template. With the tiny model's
    tokenizer given a BOS post-processor, the ingress's prompt ids follow the same rule."""
    from starlette.requests import Request

    from router.ingress_config import IngressConfig
    from router.prepare import RequestPreparer
    from router.tokenizer import PromptTokenizer

    _, bos = tiny_tokenizer_with_bos(tmp_path)
    prepare = RequestPreparer(IngressConfig("m", 4096, 32), PromptTokenizer(tmp_path))
    http = Request({"type": "http", "headers": []})

    def ids(body: dict[str, Any]) -> list[int]:
        routed, _ = prepare.prepared(http, CompletionRequest.model_validate({**COMPLETION, **body}))
        return routed.request.prompt_token_ids

    assert ids({})[0] == bos and ids({"add_special_tokens": True}) == ids({})
    assert ids({"add_special_tokens": False}) == ids({})[1:]
    assert ids({"prompt": [5, 6]}) == [5, 6]  # token ids go as they are


def test_prompt_text_goes_only_to_a_request_router_that_reads_it() -> None:
    """``RoutedRequest.prompt`` is for Ray's PrefixCacheAffinityRouter (the ingress does not
    pre-place): there a chat carries its messages' text and a token-id prompt a stand-in of its
    ids; an ingress that places requests itself leaves it empty, and the ids and hashes agree."""
    from starlette.requests import Request

    from engines.tiny_model import build_tiny_model
    from router.ingress_config import IngressConfig
    from router.prepare import RequestPreparer
    from router.tokenizer import PromptTokenizer

    tok = PromptTokenizer(build_tiny_model())
    http = Request({"type": "http", "headers": []})
    config = IngressConfig("m", 4096, 32)
    peer, own = RequestPreparer(config, tok), RequestPreparer(config, tok, prompt_text=False)
    chat = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}
    )
    ids = CompletionRequest.model_validate({**COMPLETION, "prompt": list(range(40, 80))})
    words = CompletionRequest.model_validate({**COMPLETION, "prompt": "hello there"})
    stand_in = " ".join(map(str, range(40, 80)))
    for req, text in ((chat, "hello there"), (ids, stand_in), (words, "hello there")):
        with_text, _ = peer.prepared(http, req)
        without, _ = own.prepared(http, req)
        assert with_text.prompt == text and without.prompt == ""
        assert without.request.prompt_token_ids == with_text.request.prompt_token_ids
        assert without.block_hashes == with_text.block_hashes


def test_chat_prompts_tokenize_as_transformers_and_vllm_do(tmp_path) -> None:
    """A chat is rendered and encoded without special tokens (vLLM's chat rule): the ingress's
    fast path through the Rust backend gives transformers' own ids for it, with a BOS
    post-processor that must not fire, special tokens and non-ASCII text in the content; a
    backend that carries its own truncation is left to transformers, which switches it off."""
    from transformers import AutoTokenizer

    from router.tokenizer import PromptTokenizer

    hf, bos = tiny_tokenizer_with_bos(tmp_path)
    chats = [
        [{"role": "user", "content": "hello there"}],
        [
            {"role": "system", "content": "You are terse.  Tabs\tand\nnewlines."},
            {"role": "user", "content": "Zürich — naïve café, 東京, 🙂 and <|im_end|> inside"},
            {"role": "assistant", "content": "<|bos|>ok<|eos|>"},
            {"role": "user", "content": " leading and trailing spaces "},
        ],
        [{"role": "user", "content": ""}],
    ]
    reference = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    tok = PromptTokenizer(tmp_path)
    assert tok._backend is not None  # the fast path is what this test compares
    for chat in chats:
        want = reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if not isinstance(want, list) else want
        assert tok.chat(chat) == list(want) and tok.chat(chat)[0] != bos

    hf.enable_truncation(max_length=4)
    hf.save(str(tmp_path / "tokenizer.json"))
    truncating = PromptTokenizer(tmp_path)
    assert truncating._backend is None
    assert truncating.chat(chats[1]) == tok.chat(chats[1])  # not cut to 4 tokens
