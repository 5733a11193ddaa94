"""Data formats: validation, typed errors naming the value, JSON round trips."""

from __future__ import annotations

import json
import math

import attrs
import pytest

from twinkle_core import InputFeature, Message, SampledSequence, SampleResponse, SamplingParams, Tool, Trajectory
from twinkle_core.data_format.structured import StructuredOutputs
from twinkle_core.errors import InvalidInputError, InvalidSamplingParams, TwinkleError


@pytest.mark.parametrize(
    ("field", "value", "accepted"),
    [
        ("temperature", -0.5, "0 (greedy) or a number in [0.001, 10000]"),
        ("temperature", math.nan, "0 (greedy) or a number in [0.001, 10000]"),
        ("temperature", "hot", "0 (greedy) or a number in [0.001, 10000]"),
        ("temperature", 1e-300, "below 0.001 sampling is greedy"),
        ("temperature", 1e300, "[0.001, 10000]"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.01, "(0, 1]"),
        ("top_k", 0, "-1 (disabled)"),
        ("top_k", -3, "-1 (disabled)"),
        ("top_k", 2.5, "-1 (disabled)"),
        ("min_p", 1.5, "[0, 1]"),
        ("repetition_penalty", 0.0, "[0.01, 100]"),
        ("repetition_penalty", 1e300, "[0.01, 100]"),
        ("max_tokens", -1, "integer in [0, 2147483647]"),
        ("max_tokens", True, "integer in [0, 2147483647]"),
        ("max_tokens", 2**64, "integer in [0, 2147483647]"),
        ("num_samples", 0, "integer in [1, 4096]"),
        ("num_samples", 10**6, "integer in [1, 4096]"),
        ("logprobs", -1, "integer >= 0 or None"),
        ("prompt_logprobs", -2, "integer >= 0 or None"),
        ("seed", 1.5, "an integer or None"),
        ("seed", "42", "an integer or None"),
        ("stop", 5, "non-empty string"),
        ("stop", [""], "non-empty string"),
        ("stop_token_ids", [-1], "token ids"),
        ("ignore_eos", "yes", "True or False"),
        ("logprobs_mode", "processed_logits", "'processed' or 'raw'"),
        ("bad_words", ["\n"], "strings with text other than whitespace"),
        ("bad_words", ["ok", ""], "strings with text other than whitespace"),
    ],
)
def test_sampling_params_reject_bad_values_naming_field_value_and_range(field, value, accepted):
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(**{field: value})
    msg = str(info.value)
    assert f"SamplingParams.{field}={value!r}" in msg
    assert accepted in msg
    assert isinstance(info.value, ValueError) and isinstance(info.value, TwinkleError)


def test_sampling_params_defaults_and_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=[2, 3])
    assert p.stop == ("###",) and p.stop_token_ids == (2, 3)
    assert p.logprobs_mode == "processed" and p.top_k == -1 and p.num_samples == 1
    assert SamplingParams(temperature=0).greedy


def test_sampling_params_from_dict_unknown_key_did_you_mean_and_alias():
    with pytest.raises(InvalidSamplingParams, match=r"'temprature'.*Did you mean 'temperature'"):
        SamplingParams.from_dict({"temprature": 0.5})
    assert SamplingParams.from_dict({"max_new_tokens": 7}).max_tokens == 7
    with pytest.raises(InvalidSamplingParams, match="given twice"):
        SamplingParams.from_dict({"max_new_tokens": 7, "max_tokens": 8})
    with pytest.raises(InvalidSamplingParams, match="expected a SamplingParams, a dict or None"):
        SamplingParams.coerce([1, 2])


def test_sampling_params_takes_its_documented_aliases_as_keywords_too():
    # docs/concepts.md: num_samples (alias n), max_tokens (alias max_new_tokens), the same in every form
    built = SamplingParams(n=3, max_new_tokens=7)
    assert (
        built == SamplingParams(num_samples=3, max_tokens=7) == SamplingParams.from_dict({"n": 3, "max_new_tokens": 7})
    )
    with pytest.raises(InvalidSamplingParams, match=r"keyword 'num_samples' given twice \(as 'n' and its alias\)"):
        SamplingParams(num_samples=2, n=3)
    with pytest.raises(InvalidSamplingParams, match=r"num_samples=0 is invalid"):
        SamplingParams(n=0)


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (
            lambda: SamplingParams(temprature=0.5),
            InvalidSamplingParams,
            r"keyword 'temprature'\. Did you mean 'temperature'",
        ),
        (lambda: StructuredOutputs(jsn={}), InvalidSamplingParams, r"keyword 'jsn'\. Did you mean 'json'"),
        (lambda: Trajectory(mesages=[]), InvalidInputError, r"keyword 'mesages'\. Did you mean 'messages'"),
        (
            lambda: InputFeature(input_ids=[1], mask=[1]),
            InvalidInputError,
            r"keyword 'mask'.*Accepted keywords: input_ids,",
        ),
    ],
)
def test_an_unknown_keyword_names_what_is_accepted(build, error, match):
    # a typed error (still a TypeError, as Python's own for an unexpected keyword), not a bare TypeError
    with pytest.raises(error, match=match) as caught:
        build()
    assert isinstance(caught.value, TypeError)
    assert "Accepted keywords:" in str(caught.value)


def test_json_object_false_alone_is_refused_by_name():
    # False asks for no constraint: the error says so and names it (it used to read "structured_outputs={}")
    with pytest.raises(InvalidSamplingParams, match=r"\{'json_object': False\}.*json_object true when it is") as e:
        SamplingParams(structured_outputs={"json_object": False})
    assert e.value.field == "structured_outputs"
    assert SamplingParams(structured_outputs={"json_object": True}).structured_outputs.kind == "json_object"
    # beside another constraint it is that constraint's record, as to_dict() writes it
    params = SamplingParams(structured_outputs={"regex": "[0-9]+", "json_object": False})
    assert params.structured_outputs.kind == "regex" and SamplingParams.from_dict(params.to_dict()) == params


def test_records_built_by_keyword_still_copy_pickle_and_evolve():
    import copy
    import pickle

    p = SamplingParams(temperature=0.5, stop=["x"])
    assert pickle.loads(pickle.dumps(p)) == p == copy.deepcopy(p)
    assert attrs.evolve(p, top_p=0.5).top_p == 0.5
    with pytest.raises(InvalidSamplingParams, match="'topp'"):
        attrs.evolve(p, topp=0.5)


def test_sampling_params_json_round_trip():
    p = SamplingParams(max_tokens=5, temperature=0.3, top_k=4, stop=["a", "bc"], seed=3, logprobs=2, num_samples=2)
    again = SamplingParams.from_dict(json.loads(json.dumps(p.to_dict())))
    assert again == p
    assert p.replace(seed=4).seed == 4
    with pytest.raises(InvalidSamplingParams):
        p.replace(top_p=2.0)


def test_trajectory_round_trip_with_tools_and_tool_messages():
    traj = Trajectory(
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "weather?"},
            Message(
                role="assistant",
                content="",
                tool_calls=[{"type": "function", "function": {"name": "w", "arguments": {}}}],
            ),
            {"role": "tool", "content": "sunny", "tool_call_id": "1"},
        ],
        tools=[
            {"type": "function", "function": {"name": "w", "description": "weather", "parameters": {"type": "object"}}}
        ],
        extra={"id": 7},
    )
    assert traj.tools == [Tool(name="w", description="weather", parameters={"type": "object"})]
    again = Trajectory.from_dict(json.loads(json.dumps(traj.to_dict())))
    assert again == traj
    assert traj.messages[2].to_hf()["tool_calls"][0]["function"]["name"] == "w"


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"content": "x"}]}, "has no 'role'"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "role='robot'.*system, developer, user, assistant, tool"),
        ({"messages": [{"role": "user", "content": 3}]}, "content=3"),
        ({"messages": [{"role": "user", "content": "x"}], "toolz": []}, "Did you mean 'tools'"),
        ({"messages": "hi"}, "non-empty list"),
        ({"messages": [{"role": "user", "content": ["hi"]}]}, r"content\[0\]='hi'.*content part"),
        ({"messages": [{"role": "user", "content": [{"text": "hi"}]}]}, "string 'type'"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "needs a string 'text'"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}, "lone surrogate"),
    ],
)
def test_malformed_trajectories_raise_invalid_input(data, match):
    with pytest.raises(InvalidInputError, match=match):
        Trajectory.from_dict(data)


def test_input_feature_validation_and_defaults():
    f = InputFeature(input_ids=(1, 2, 3))
    assert f.input_ids == [1, 2, 3] and f.attention_mask == [1, 1, 1] and f.labels is None
    with pytest.raises(InvalidInputError, match="labels has length 2"):
        InputFeature(input_ids=[1, 2, 3], labels=[1, 2])
    with pytest.raises(InvalidInputError, match="flat list of integers"):
        InputFeature(input_ids=[[1, 2]])
    assert InputFeature.from_dict(f.to_dict()) == f


def test_outputs_round_trip_through_json():
    seq = SampledSequence(
        tokens=[5, 6],
        text="ab",
        logprobs=[-0.1, -0.2],
        top_logprobs=[[(5, -0.1), (7, -2.0)], [(6, -0.2), (9, -3.0)]],
        stop_reason="stop",
        stop=6,
        weights_version=3,
        adapter_name="a",
        training_feature=InputFeature(input_ids=[1, 5, 6], labels=[-100, 5, 6]),
    )
    resp = SampleResponse(prompt_token_ids=[1], sequences=[seq], prompt_logprobs=[None])
    again = SampleResponse.from_dict(json.loads(json.dumps(resp.to_dict())))
    assert again == resp
    with pytest.raises(ValueError, match="stop_reason='done'"):
        SampledSequence(tokens=[], text="", stop_reason="done")


def test_errors_with_attributes_survive_pickling():
    import pickle

    from twinkle_core.errors import PromptTooLongError, WeightSyncTimeoutError

    e = pickle.loads(pickle.dumps(PromptTooLongError("too long", index=2, length=9, limit=8)))
    assert (str(e), e.index, e.length, e.limit) == ("too long", 2, 9, 8)
    t = pickle.loads(pickle.dumps(WeightSyncTimeoutError("slow", stage="ack")))
    assert isinstance(t, TimeoutError) and t.stage == "ack"
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(num_samples=0)
    p = pickle.loads(pickle.dumps(info.value))
    assert p.field == "num_samples" and str(p) == str(info.value)


def test_input_ids_take_integer_scalars_of_numpy_and_torch():
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    feature = InputFeature(input_ids=[np.int64(3), np.uint8(4), torch.tensor(5), 6])
    assert feature.input_ids == [3, 4, 5, 6] and all(type(t) is int for t in feature.input_ids)
    for bad in ([np.float32(3)], [np.bool_(True)], [torch.tensor([1, 2])], [torch.tensor(1.0)]):
        with pytest.raises(InvalidInputError, match="flat list of integers"):
            InputFeature(input_ids=bad)


def test_extra_that_is_not_a_dict_and_unrenderable_json_are_input_errors() -> None:
    from twinkle_core.inputs import normalize_inputs

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(InvalidInputError, match=r"Trajectory.extra=5 is invalid: expected a dict"):
        Trajectory.from_dict({**chat, "extra": 5})
    with pytest.raises(InvalidInputError, match=r"InputFeature.extra=\[1\] is invalid"):
        InputFeature(input_ids=[1], extra=[1])  # type: ignore[arg-type]
    skipped = normalize_inputs([{**chat, "extra": 5}, chat], on_invalid="skip")
    assert isinstance(skipped[0], InvalidInputError) and isinstance(skipped[1], Trajectory)
    deep: dict = {}
    for _ in range(100):
        deep = {"a": deep}
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}]
    with pytest.raises(InvalidInputError, match="nests deeper than 64 levels"):
        Message(role="assistant", tool_calls=calls)
    with pytest.raises(InvalidInputError, match="lone surrogate"):
        Message(role="assistant", tool_calls=[{"function": {"name": "f", "arguments": {"\ud800": 1}}}])
    with pytest.raises(InvalidInputError, match="nests deeper"):
        Tool(name="f", parameters=deep)
