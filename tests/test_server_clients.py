"""``twinkle serve`` as a drop-in for vLLM's server: the clients people already run, unmodified.

TRL's ``VLLMClient``, lm-evaluation-harness's ``local-completions`` model and
the OpenAI Agents SDK each drive a real server over the tiny model, on the
torch engine and on the vLLM engine (one server per engine for the module).
Expectations come from the same sampler in process.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
trl_client = pytest.importorskip("trl.generation.vllm_client")
lm_eval = pytest.importorskip("lm_eval")
agents = pytest.importorskip("agents")

from twinkle_core.server import RunningServer, start_server  # noqa: E402
from twinkle_core.testing import build_tiny_model  # noqa: E402

ENGINES = ["torch", "vllm"]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return build_tiny_model("llama")


@pytest.fixture(scope="module", params=ENGINES)
def served(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[tuple[Any, RunningServer]]:
    if request.param == "torch":
        from twinkle_torch.sampler import TorchSampler

        sampler: Any = TorchSampler(model_dir, device="cpu")
    else:
        pytest.importorskip("vllm")
        from twinkle_vllm.sampler import vLLMSampler

        args = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30, "dtype": "float32", "max_num_seqs": 64}
        sampler = vLLMSampler(model_dir, engine_args=args)
    with sampler, start_server(sampler, model_name="tiny") as srv:
        yield sampler, srv


def _chat_ids(sampler: Any, text: str) -> list[int]:
    return list(sampler.template.encode({"messages": [{"role": "user", "content": text}]}).input_ids)


# -- TRL ---------------------------------------------------------------------------------------------------------


def test_trl_generate_token_prompts(served: tuple[Any, RunningServer]) -> None:
    sampler, srv = served
    client = trl_client.VLLMClient(base_url=srv.url, connection_timeout=10)
    prompts = [_chat_ids(sampler, "Hi!"), _chat_ids(sampler, "What is the capital of France?")]
    out = client.generate(prompts, n=2, temperature=0.0, max_tokens=8, logprobs=2)
    assert out["prompt_ids"] == prompts
    direct = sampler.sample([{"input_ids": p} for p in prompts], {"temperature": 0, "max_tokens": 8, "logprobs": 2})
    expected = [seq.tokens for resp in direct for seq in resp.sequences]
    assert out["completion_ids"] == [expected[0], expected[0], expected[1], expected[1]]
    # per position: the sampled token first (greedy: also the most likely), sorted by log-prob
    for ids, lps, tokens in zip(out["logprob_token_ids"], out["logprobs"], out["completion_ids"]):
        assert [row[0] for row in ids] == tokens
        assert all(row == sorted(row, reverse=True) for row in lps)
    first = direct[0].sequences[0]
    assert [row[0] for row in out["logprobs"][0]] == pytest.approx(first.logprobs, abs=1e-5)


def test_trl_generate_text_and_chat(served: tuple[Any, RunningServer]) -> None:
    sampler, srv = served
    client = trl_client.VLLMClient(base_url=srv.url, connection_timeout=10)
    texts = ["The quick brown fox", "Numbers: 0 1 2"]
    out = client.generate(texts, temperature=0.0, max_tokens=6)
    assert out["prompt_ids"] == [sampler.template.tokenizer.encode(t) for t in texts]
    chat = client.chat([[{"role": "user", "content": "Hi!"}]], temperature=0.0, max_tokens=6, repetition_penalty=1.2)
    direct = sampler.sample(
        {"messages": [{"role": "user", "content": "Hi!"}]},
        {"temperature": 0, "max_tokens": 6, "repetition_penalty": 1.2},
    )[0]
    assert chat["prompt_ids"] == [_chat_ids(sampler, "Hi!")]
    assert chat["completion_ids"] == [direct.sequences[0].tokens]
    assert client.get_world_size() == 1
    assert client.get_server_info()["model_config"]["max_model_len"] == sampler.max_model_len
    client.reset_prefix_cache()


def test_trl_sequence_logprobs_are_prompt_logprobs(served: tuple[Any, RunningServer]) -> None:
    sampler, srv = served
    client = trl_client.VLLMClient(base_url=srv.url, connection_timeout=10)
    prompt = _chat_ids(sampler, "Tell me about a fox.")
    completion = sampler.sample({"input_ids": prompt}, {"temperature": 0, "max_tokens": 6})[0].sequences[0].tokens
    sequence = prompt + completion
    out = client.get_sequence_logprobs([sequence], [len(prompt)], top_logprobs=3)
    direct = sampler.sample({"input_ids": sequence}, {"max_tokens": 1, "prompt_logprobs": 3})[0]
    actual = [row[0] for row in out["actual_logprobs"][0]]
    assert actual == pytest.approx(direct.prompt_logprobs[len(prompt) :], abs=1e-5)
    tops = direct.prompt_top_logprobs[len(prompt) :]
    assert out["logprob_token_ids"][0] == [[t for t, _ in row] for row in tops]
    assert [r[0] for r in out["logprobs"][0]] == pytest.approx([row[0][1] for row in tops], abs=1e-5)


# -- lm-evaluation-harness ---------------------------------------------------------------------------------------

_DOCS = [
    {"question": "What is the capital of France?", "choices": ["Paris", "Rome", "Oslo"], "answer": 0},
    {"question": "What is two plus two?", "choices": ["three", "four", "five"], "answer": 1},
    {"question": "What color is the sky?", "choices": ["green", "red", "blue"], "answer": 2},
]

_MC_TASK = """
task: twinkle_mc
dataset_path: json
dataset_kwargs:
  data_files: {path}
test_split: train
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""

_GEN_TASK = """
task: twinkle_gen
dataset_path: json
dataset_kwargs:
  data_files: {path}
test_split: train
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from lm_eval.tasks import TaskManager

    root = tmp_path_factory.mktemp("lm_eval_tasks")
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in _DOCS))
    (root / "twinkle_mc.yaml").write_text(_MC_TASK.format(path=data))
    (root / "twinkle_gen.yaml").write_text(_GEN_TASK.format(path=data))
    return TaskManager(include_path=str(root))


def _evaluate(tasks: Any, model: str, model_args: dict[str, Any], task: str) -> dict[str, Any]:
    from lm_eval import simple_evaluate

    return simple_evaluate(model=model, model_args=model_args, tasks=[task], task_manager=tasks, log_samples=True)


@pytest.fixture(scope="module")
def hf_loglikelihoods(tasks: Any, model_dir: Path) -> dict[str, Any]:
    return _evaluate(tasks, "hf", {"pretrained": str(model_dir), "dtype": "float32", "device": "cpu"}, "twinkle_mc")


def _server_args(srv: RunningServer, **extra: Any) -> dict[str, Any]:
    # no tokenizer named: lm-eval finds the server's /tokenizer_info and /tokenize and uses them
    return {"base_url": srv.url + "/v1/completions", "model": "tiny", "max_retries": 1, "num_concurrent": 1, **extra}


def test_lm_eval_loglikelihood_matches_hf(
    served: tuple[Any, RunningServer], tasks: Any, hf_loglikelihoods: dict[str, Any]
) -> None:
    _, srv = served
    ours = _evaluate(tasks, "local-completions", _server_args(srv, batch_size=4), "twinkle_mc")
    ref = hf_loglikelihoods
    assert ours["results"]["twinkle_mc"]["acc,none"] == ref["results"]["twinkle_mc"]["acc,none"]
    mine = sorted(ours["samples"]["twinkle_mc"], key=lambda s: s["doc_id"])
    theirs = sorted(ref["samples"]["twinkle_mc"], key=lambda s: s["doc_id"])
    for a, b in zip(mine, theirs, strict=True):
        got = [float(r[0][0]) for r in a["resps"]]
        want = [float(r[0][0]) for r in b["resps"]]
        assert all(math.isfinite(x) for x in got)
        assert got == pytest.approx(want, abs=1e-3)  # float32 on two code paths over a few tokens


def test_lm_eval_generate_until_matches_the_engine(served: tuple[Any, RunningServer], tasks: Any) -> None:
    sampler, srv = served
    ours = _evaluate(tasks, "local-completions", _server_args(srv), "twinkle_gen")
    for sample in ours["samples"]["twinkle_gen"]:
        doc = _DOCS[sample["doc_id"]]
        prompt = f"Question: {doc['question']}\nAnswer:"
        ids = sampler.template.tokenizer.encode(prompt)
        seq = sampler.sample({"input_ids": ids}, {"temperature": 0, "max_tokens": 8, "stop": ["\n"]})[0].sequences[0]
        assert sample["resps"][0][0] == seq.text
    expected = sum(s["target"] == s["resps"][0][0].strip() for s in ours["samples"]["twinkle_gen"]) / len(_DOCS)
    assert ours["results"]["twinkle_gen"]["exact_match,none"] == pytest.approx(expected)


# -- OpenAI Agents SDK -------------------------------------------------------------------------------------------


def test_agents_sdk_tool_loop_is_one_token_exact_episode(served: tuple[Any, RunningServer]) -> None:
    sampler, srv = served
    from agents import Agent, FunctionTool, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    asked: list[str] = []

    async def get_weather(ctx: Any, arguments: str) -> str:
        asked.append(json.loads(arguments)["city"])
        return "21 degrees and sunny"

    tool = FunctionTool(
        name="get_weather",
        description="Get the weather in a city.",
        params_json_schema={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        on_invoke_tool=get_weather,
        strict_json_schema=False,  # the SDK still sends OpenAI's `strict` key
    )
    session = f"agent-{type(sampler).__name__}"
    agent = Agent(
        name="weather",
        tools=[tool],
        model=OpenAIChatCompletionsModel(
            model="tiny", openai_client=AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        ),
        model_settings=ModelSettings(temperature=0, max_tokens=48, extra_headers={"X-Session-Id": session}),
    )
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"] and len(asked) == 1
    exported = httpx.get(srv.url + f"/v1/sessions/{session}").json()
    assert exported["episodes"] == 1 and exported["turns"] == 2  # both turns in one episode
    [episode] = exported["data"]
    feature = episode["feature"]
    turns = feature["extra"]["turns"]
    # token-exact: the sampled turns are where the loss mask is, and they decode to what the agent saw
    masked = [i for i, m in enumerate(feature["extra"]["loss_mask"]) if m]
    assert masked == [i for t in turns for i in range(t["start"], t["end"])]
    last = feature["input_ids"][turns[-1]["start"] : turns[-1]["end"]]
    assert sampler.template.decode(last).strip() == result.final_output.strip()
    # the opening prompt is the template's rendering of the user's message, tools included
    opening = sampler.template.encode(
        {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": [tool_schema(tool)]}
    ).input_ids
    assert feature["input_ids"][: len(opening)] == opening


def tool_schema(tool: Any) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": tool.params_json_schema},
    }
