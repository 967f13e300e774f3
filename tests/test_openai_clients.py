"""What a newcomer's first hour sends: the README's first OpenAI calls on the bundled model, and
the fields OpenAI clients and load generators (guidellm, langchain) put in their requests.

One real server subprocess (the bundled model, context 1024) serves the module; the clients are
the real ``openai`` package and raw HTTP where a field is not in the SDK's signature.
"""

from __future__ import annotations

import pytest
from reliability_support import sse_frames

requests = pytest.importorskip("requests")
openai = pytest.importorskip("openai")

CONTEXT = 1024
# The bundled model's task (docs/default_model.md): the family's code is in its few-shot block,
# here in the system message; the chat template renders it as "Question: X\nAnswer:" turns.
SHOTS = "Question: K\nAnswer: 7\n\nQuestion: D\nAnswer: 7\n\nQuestion: M\nAnswer: 7"
PROMPT = SHOTS + "\n\nQuestion: D\nAnswer:"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from bicache_sgl.runtime import Runtime

    folder = tmp_path_factory.mktemp("openai_clients")
    rt = Runtime(num_threads=1, max_running_requests=8, context_length=CONTEXT, timeout=180,
                 log_path=str(folder / "server.log"))
    yield rt
    rt.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def post(server, path, payload):
    return requests.post(server.url + path, json=payload, timeout=120)


# ------------------------------------------------------------------------------------------------
# the bundled model answers chat, under its short name
# ------------------------------------------------------------------------------------------------

def test_first_chat_call_on_bundled_model_answers_with_the_family_code(client):
    """The README's first OpenAI chat call: non-empty text, the code from the few-shot block."""
    r = client.chat.completions.create(model="bicache-default", temperature=0, max_tokens=8,
                                       messages=[{"role": "system", "content": SHOTS},
                                                 {"role": "user", "content": "D"}])
    assert r.choices[0].message.content == " 7"
    assert r.choices[0].finish_reason == "stop" and r.model == "bicache-default"
    # the template rendered exactly the trained prompt: its token count is the prompt's characters
    assert r.usage.prompt_tokens == len(PROMPT)


def test_chat_turns_render_like_the_completion_prompt(client):
    """Earlier user/assistant turns are the few-shot block: same answer as /v1/completions."""
    msgs = [{"role": "user", "content": "K"}, {"role": "assistant", "content": " 7"},
            {"role": "user", "content": "D"}, {"role": "assistant", "content": "7"},
            {"role": "user", "content": "M"}, {"role": "assistant", "content": " 7"},
            {"role": "user", "content": "D"}]
    chat = client.chat.completions.create(model="bicache-default", messages=msgs, temperature=0, max_tokens=8)
    comp = client.completions.create(model="bicache-default", prompt=PROMPT, temperature=0, max_tokens=8)
    assert chat.choices[0].message.content == comp.choices[0].text == " 7"
    assert chat.usage.prompt_tokens == comp.usage.prompt_tokens == len(PROMPT)


def test_models_lists_the_short_name_and_path_or_name_both_work(server, client):
    cards = client.models.list().data
    assert [c.id for c in cards] == ["bicache-default"]
    info = requests.get(server.url + "/get_model_info", timeout=30).json()
    path = info["model_path"]
    assert path.endswith("default_model") and cards[0].model_extra["root"] == path
    for name in ("bicache-default", path, "default_model"):
        r = client.completions.create(model=name, prompt=PROMPT, temperature=0, max_tokens=4)
        assert r.choices[0].text == " 7" and r.model == "bicache-default"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=4)


def test_chat_template_refuses_roles_the_model_was_not_trained_on(server):
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "tool", "content": "x", "tool_call_id": "a"}]})
    assert r.status_code == 400 and "trained on" in r.json()["error"]["message"]


def test_served_model_name_flag_and_default_rule():
    """SGLang's rule for any model: --served-model-name, else the model path; bundled: short."""
    from bicache_sgl.models.loader import default_model_path
    from bicache_sgl.server.args import default_served_model_name

    assert default_served_model_name(default_model_path()) == "bicache-default"
    assert default_served_model_name(default_model_path().replace("default_model", "context_model")) == \
        "bicache-context"
    assert default_served_model_name("/data/LLaDA-8B-Instruct") == "/data/LLaDA-8B-Instruct"


def sse(resp) -> list:
    return sse_frames(resp.iter_lines(decode_unicode=False))
