"""`starpu-llm serve`'s chat completions (serve/chat.py) and scoring (serve/scoring.py:
logprobs, echo with max_tokens 0, penalties, logit_bias) through the official openai client,
against the reference engine's logits computed here one position at a time.

The bound: two computations of the logits differ by at most delta = bounds.logits_bound (per
logit, max norm); log_softmax(x)_i = x_i - logsumexp(x), and logsumexp moves by at most the
max-norm change of x, so a log-probability moves by at most 2 delta; the server's float64
log-softmax of its fp32 logits adds rounding below 1e-9 (V terms of 1e-16 relative error on
values below 1e3). The k-th largest log-probability is 1-Lipschitz in the max norm too, so the
sorted top_logprobs values are within the same bound whichever ids they belong to."""
import json

import httpx
import numpy as np
import openai
import pytest

from bounds import logits_bound
from starpu_llm.flow import generate as gen
from starpu_llm.io import tokenizer
from starpu_llm.serve import chat
from test_batch import peaked_params
from test_serve import GREEDY, TINY, Server, ckpts, text_of  # noqa: F401 (ckpts: a fixture)

TOK = tokenizer.gpt2()
ROUNDING = 1e-9
CONVERSATION = [{"role": "system", "content": "You are brief."},
                {"role": "user", "content": "What is StarPU?"}]
# a template as Hugging Face tokenizers ship them: raise_exception for a conversation it refuses
CUSTOM = ("{% for m in messages %}{% if loop.first and m['role'] == 'assistant' %}"
          "{{ raise_exception('a conversation starts with a system or user message') }}"
          "{% endif %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
          "{% if add_generation_prompt %}[assistant]{% endif %}")


class Oracle:
    """The reference engine's logits after each token of a sequence, one position a step."""

    def __init__(self):
        self.backend = gen.DirectBackend(TINY, peaked_params(TINY))

    def logits(self, ids) -> list:
        """[logits after ids[0], after ids[:2], ...]."""
        decoder = gen.Decoder(self.backend)
        return [decoder.feed([[t]])[0].astype(np.float64) for t in ids]

    def greedy(self, ids, n, change=lambda logits, drawn: logits) -> list:
        """n tokens after ids, each the argmax of change(logits, tokens drawn so far), whose
        lead over the second exceeds twice the bound (so the server picks it too)."""
        decoder = gen.Decoder(self.backend)
        logits = decoder.feed([ids])[0].astype(np.float64)
        out = []
        for _ in range(n):
            x = change(logits, out)
            top2 = np.sort(x)[-2:]
            bound = logits_bound(TINY, 1, len(ids) + len(out), np.abs(logits).max())
            assert top2[1] - top2[0] > 2 * bound, "the logits are not peaked enough"
            out.append(int(np.argmax(x)))
            logits = decoder.feed([[out[-1]]])[0].astype(np.float64)
        return out


def log_softmax(x):
    z = x - x.max()
    return z - np.log(np.exp(z).sum())


def lp_bound(logits, T):
    return 2 * logits_bound(TINY, 1, T, np.abs(logits).max()) + ROUNDING


@pytest.fixture(scope="module")
def oracle():
    return Oracle()


@pytest.fixture(scope="module")
def server(ckpts):
    template = ckpts["dir"] / "custom.jinja"
    template.write_text(CUSTOM)
    default = Server(ckpts["tiny"], ckpts["dir"], "--max-batch", 4, name="chat")
    custom = Server(ckpts["tiny"], ckpts["dir"], "--max-batch", 2, "--chat-template", template,
                    name="chat-custom")
    yield default, custom
    assert default.stop() == 0, default.output()
    assert custom.stop() == 0, custom.output()


def test_default_template_is_documented():
    assert chat._default().render(CONVERSATION) == \
        "System: You are brief.\n\nUser: What is StarPU?\n\nAssistant:"


def test_chat_whole_and_streamed(server, oracle):
    default, custom = server
    for s, prompt in ((default, chat._default().render(CONVERSATION)),
                      (custom, "[system] You are brief.\n[user] What is StarPU?\n[assistant]")):
        ids = TOK.encode(prompt)
        want = text_of(oracle.greedy(ids, 8))
        client = s.client(max_retries=0, timeout=120)
        r = client.chat.completions.create(model="tiny", messages=CONVERSATION,
                                           max_completion_tokens=8, **GREEDY)
        assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == want
        assert r.choices[0].finish_reason == "length" and r.choices[0].logprobs is None
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 8)
        chunks = list(client.chat.completions.create(
            model="tiny", messages=CONVERSATION, max_tokens=8, stream=True,
            stream_options={"include_usage": True}, **GREEDY))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert all(c.object == "chat.completion.chunk" for c in chunks)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.prompt_tokens == len(ids)
    # n choices, each its own stream of the same conversation
    r = default.client(max_retries=0, timeout=120).chat.completions.create(
        model="tiny", messages=CONVERSATION, max_tokens=4, n=2, seed=7)
    assert [c.index for c in r.choices] == [0, 1]


def test_chat_without_a_length_runs_to_the_end_of_the_context(server):
    """OpenAI's chat API has no default length (the completions API's is 16 tokens): a chat
    request without max_completion_tokens or max_tokens goes on until the context is full
    (or a stop; it ended after 16 tokens, finish_reason "length")."""
    r = server[0].client(max_retries=0, timeout=120).chat.completions.create(
        model="tiny", messages=CONVERSATION, **GREEDY)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == TINY.max_seq_len


def test_a_developer_message_is_a_system_message(server):
    """OpenAI's "developer" role (the newer name of "system", as its SDK and some frontends
    send it): the same conversation, the same greedy answer (it was a 400)."""
    client = server[0].client(max_retries=0, timeout=120)
    said = [client.chat.completions.create(
        model="tiny", messages=[{"role": role, "content": "Speak in verse."},
                                {"role": "user", "content": "Hello"}],
        max_tokens=4, **GREEDY).choices[0].message.content for role in ("developer", "system")]
    assert said[0] == said[1]


BAD_CHAT = [
    ({"model": "tiny"}, "messages is required"),
    ({"model": "tiny", "messages": []}, "messages must be a non-empty list"),
    ({"model": "tiny", "messages": [{"role": "robot", "content": "Hi"}]},
     "messages[0].role must be one of system, user, assistant"),
    ({"model": "tiny", "messages": [{"role": ["user"], "content": "Hi"}]},
     "messages[0].role must be one of system, user, assistant, developer, got [\"user\"]"),
    ({"model": "tiny", "messages": [{"role": "user", "content": 5}]},
     "messages[0].content must be a string"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "Hi", "name": 5}]},
     "messages[0].name must be a string"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2},
     "top_logprobs needs logprobs: true"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
      "top_logprobs": 21}, "top_logprobs must be in 0..20"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "tools": []},
     "unknown field 'tools'"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "Hi " * 80}]},
     "messages, through the chat template"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
      "max_completion_tokens": 1000}, "lower max_completion_tokens to at most"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
      "max_completion_tokens": 3, "max_tokens": 3}, "give max_completion_tokens or max_tokens"),
]


@pytest.mark.parametrize("body,message", BAD_CHAT, ids=[m for _, m in BAD_CHAT])
def test_bad_chat_input_is_400_naming_the_field(server, body, message):
    r = httpx.post(server[0].url + "/v1/chat/completions", content=json.dumps(body),
                   timeout=120)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"], r.json()


def test_the_templates_refusal_is_400(server):
    """raise_exception in a template: a 400 with its message."""
    with pytest.raises(openai.BadRequestError, match="starts with a system or user message"):
        server[1].client(max_retries=0, timeout=120).chat.completions.create(
            model="tiny", messages=[{"role": "assistant", "content": "Hi"}])


def test_bad_template_file_exits_2(ckpts, tmp_path):
    import subprocess
    import sys
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }")
    raising = tmp_path / "raising.jinja"
    raising.write_text("{{ raise_exception('no assistant turns here') }}")
    for path, words in ((tmp_path / "none.jinja", "cannot read it"),
                        (bad, "not a valid Jinja2 template"),
                        (raising, "no assistant turns here")):
        p = subprocess.run([sys.executable, "-m", "starpu_llm", "serve", "--init-from",
                            str(ckpts["tiny"]), "--port", "0", "--chat-template", str(path)],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 2, p.stderr
        assert f"--chat-template {path}" in p.stderr and words in p.stderr, p.stderr
        assert "Traceback" not in p.stderr


def test_completion_logprobs_against_the_logits(server, oracle):
    client = server[0].client(max_retries=0, timeout=120)
    prompt = "The quick brown fox"
    ids = TOK.encode(prompt)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, logprobs=3,
                                  **GREEDY)
    tokens = oracle.greedy(ids, 6)
    lp = r.choices[0].logprobs
    assert lp.tokens == [TOK.decode([t]) for t in tokens]
    # streamed: each event carries the scores of its tokens
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=6,
                                            logprobs=3, stream=True, **GREEDY))
    streamed = [(t, v) for c in chunks if c.choices and c.choices[0].logprobs
                for t, v in zip(c.choices[0].logprobs.tokens,
                                c.choices[0].logprobs.token_logprobs)]
    assert [t for t, _ in streamed] == lp.tokens
    # the offsets run on over the events, as in the whole answer (each event's were 0)
    assert [o for c in chunks if c.choices and c.choices[0].logprobs
            for o in c.choices[0].logprobs.text_offset] == lp.text_offset
    for i, (t, logits) in enumerate(zip(tokens, oracle.logits(ids + tokens)[len(ids) - 1:])):
        want = log_softmax(logits)
        bound = lp_bound(logits, len(ids) + i)
        assert abs(lp.token_logprobs[i] - want[t]) <= bound
        assert abs(streamed[i][1] - want[t]) <= bound
        got_top = sorted(lp.top_logprobs[i].values(), reverse=True)
        assert len(got_top) == 3
        assert np.abs(np.array(got_top) - np.sort(want)[::-1][:3]).max() <= bound
    assert lp.text_offset[0] == len(prompt)


def test_echo_scores_the_prompt(server, oracle):
    client = server[0].client(max_retries=0, timeout=120)
    prompt = "To be, or not to be"
    ids = TOK.encode(prompt)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True,
                                  logprobs=1, temperature=0)
    c = r.choices[0]
    assert c.text == prompt and r.usage.completion_tokens == 0
    assert c.logprobs.tokens == [TOK.decode([t]) for t in ids]
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    for i, logits in enumerate(oracle.logits(ids[:-1])):
        want = log_softmax(logits)
        bound = lp_bound(logits, i + 1)
        assert abs(c.logprobs.token_logprobs[i + 1] - want[ids[i + 1]]) <= bound
        (top,) = c.logprobs.top_logprobs[i + 1].values()
        assert abs(top - want.max()) <= bound
    assert c.logprobs.text_offset == [len(TOK.decode(ids[:i])) for i in range(len(ids))]
    # echo with max_tokens > 0: the prompt's scores, then the generated tokens'
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, echo=True,
                                  logprobs=0, **GREEDY)
    new = oracle.greedy(ids, 3)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == prompt + text_of(new)
    assert lp.tokens == [TOK.decode([t]) for t in ids + new]
    assert lp.token_logprobs[0] is None
    for i, logits in enumerate(oracle.logits(ids + new[:-1])):
        want = log_softmax(logits)[(ids + new)[i + 1]]
        assert abs(lp.token_logprobs[i + 1] - want) <= lp_bound(logits, i + 1)
    # two choices of a 40-token prompt: more scored rows than one step's head gives a group
    # (its slots + engine.SCORED_ROWS): the second choice's prompt goes over two steps
    ids = TOK.encode(" ".join(["to be, or not"] * 10))[:40]
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True,
                                  logprobs=0, n=2, temperature=0)
    logits = oracle.logits(ids[:-1])
    for c in r.choices:
        assert len(c.logprobs.token_logprobs) == 40 and c.logprobs.token_logprobs[0] is None
        for i, x in enumerate(logits):
            assert abs(c.logprobs.token_logprobs[i + 1] - log_softmax(x)[ids[i + 1]]) \
                <= lp_bound(x, i + 1)
    # echo alone with max_tokens 0: the prompt back, nothing computed
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True)
    assert r.choices[0].text == prompt and r.choices[0].logprobs is None


def test_chat_logprobs(server, oracle):
    client = server[0].client(max_retries=0, timeout=120)
    ids = TOK.encode(chat._default().render(CONVERSATION))
    r = client.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=4,
                                       logprobs=True, top_logprobs=2, **GREEDY)
    tokens = oracle.greedy(ids, 4)
    content = r.choices[0].logprobs.content
    assert [e.token for e in content] == [TOK.decode([t]) for t in tokens]
    for i, (e, logits) in enumerate(zip(content, oracle.logits(ids + tokens)[len(ids) - 1:])):
        want = log_softmax(logits)
        bound = lp_bound(logits, len(ids) + i)
        assert abs(e.logprob - want[tokens[i]]) <= bound
        assert e.bytes == list(TOK.decode_bytes([tokens[i]]))
        assert np.abs(np.array([t.logprob for t in e.top_logprobs])
                      - np.sort(want)[::-1][:2]).max() <= bound
    chunks = list(client.chat.completions.create(model="tiny", messages=CONVERSATION,
                                                 max_tokens=4, logprobs=True, top_logprobs=2,
                                                 stream=True, **GREEDY))
    streamed = [e.token for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert streamed == [e.token for e in content]


def test_penalties_and_logit_bias(server, oracle):
    client = server[0].client(max_retries=0, timeout=120)
    prompt = "ROMEO:"
    ids = TOK.encode(prompt)
    plain = oracle.greedy(ids, 12)
    favoured = plain[3]     # a token greedy draws anyway, pushed up to be drawn everywhere

    def penalised(logits, drawn, presence=1.5, frequency=2.0, bias={favoured: 30.0}):
        x = logits.copy()
        for t, b in bias.items():
            x[t] += b
        for t in set(drawn):
            x[t] -= presence + frequency * drawn.count(t)
        return x
    want = oracle.greedy(ids, 12, penalised)
    assert want != plain            # the request's changes change the greedy choice
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, logprobs=0,
                                  presence_penalty=1.5, frequency_penalty=2.0,
                                  logit_bias={str(favoured): 30}, **GREEDY)
    lp = r.choices[0].logprobs
    assert lp.tokens == [TOK.decode([t]) for t in want]
    # the log-probabilities reported are the model's own (before the changes)
    logits = oracle.logits(ids + want)[len(ids) - 1]
    assert abs(lp.token_logprobs[0] - log_softmax(logits)[want[0]]) <= lp_bound(logits, len(ids))
    with pytest.raises(openai.BadRequestError, match="presence_penalty must be a number in"):
        client.completions.create(model="tiny", prompt=prompt, presence_penalty=3)
    with pytest.raises(openai.BadRequestError, match="logit_bias key '99999'"):
        client.completions.create(model="tiny", prompt=prompt, logit_bias={"99999": 1})
    with pytest.raises(openai.BadRequestError, match="logprobs must be an integer in 0..5"):
        client.completions.create(model="tiny", prompt=prompt, logprobs=6)
