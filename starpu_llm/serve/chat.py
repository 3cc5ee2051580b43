"""OpenAI's chat completions API: a conversation (messages) made into one prompt by a chat
template, then generated as a completion (serve/api.py checks the shared fields, the engine
runs it); the response objects in the chat shape. No HTTP here (serve/app.py).

A chat template is Jinja2, the form Hugging Face tokenizers ship theirs in
(tokenizer_config.json's "chat_template"): it gets `messages` (each {"role", "content"}),
`add_generation_prompt` (true), `bos_token` and `eos_token` (both <|endoftext|> for GPT-2's
vocabulary) and `raise_exception(message)`, and is rendered in Jinja2's sandbox with
trim_blocks and lstrip_blocks, as transformers does. GPT-2 is a base model with no template of
its own: DEFAULT_TEMPLATE writes each message as "Role: content" and a blank line, and ends
with "Assistant:" for the model to continue (docs/serving.md). `starpu-llm serve
--chat-template FILE` takes another.
"""
from __future__ import annotations

import functools
import json

from ..errors import StarpuLLMError
from . import api, scoring
from .api import BadRequest

DEFAULT_TEMPLATE = ("{% for message in messages %}"
                    "{{ message.role | capitalize }}: {{ message.content }}\n\n"
                    "{% endfor %}"
                    "{% if add_generation_prompt %}Assistant:{% endif %}")
ROLES = ("system", "user", "assistant")
# OpenAI's newer name for system messages (its SDK sends what the caller wrote): the template
# gets "system"
ALIASES = {"developer": "system"}
EOS = "<|endoftext|>"

# chat fields read here; the others are the completions API's own (api.parse_completion)
_OWN = {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
_SHARED = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed",
           "stream", "stream_options", "user", "ignore_eos", "logit_bias", "presence_penalty",
           "frequency_penalty"}
_FIELDS = _OWN | _SHARED


class Template:
    """A compiled chat template: render(messages) -> the prompt text (jinja2's errors raised)."""

    def __init__(self, source: str):
        import jinja2.sandbox

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True,
                                                           lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        self.template = env.from_string(source)

    def render(self, messages) -> str:
        return self.template.render(messages=messages, add_generation_prompt=True,
                                    bos_token=EOS, eos_token=EOS)


def load_template(path) -> Template:
    """--chat-template FILE compiled and tried on a short conversation: a clear error
    (StarpuLLMError) for a file that cannot be read, is not Jinja2 or does not render."""
    import jinja2
    flag = f"--chat-template {path}"
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except OSError as e:
        raise StarpuLLMError(f"{flag}: cannot read it ({e.strerror}); give a Jinja2 chat "
                             f"template file") from None
    except UnicodeDecodeError:
        raise StarpuLLMError(f"{flag}: not UTF-8 text; give a Jinja2 chat template "
                             f"file") from None
    try:
        template = Template(source)
    except jinja2.TemplateSyntaxError as e:
        raise StarpuLLMError(f"{flag}: not a valid Jinja2 template (line {e.lineno}: "
                             f"{e.message})") from None
    sample = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"},
              {"role": "user", "content": "How are you?"}]
    try:
        template.render(sample)
    except Exception as e:           # noqa: BLE001 (any error of the template's own code)
        raise StarpuLLMError(f"{flag}: rendering a user/assistant/user conversation failed "
                             f"({type(e).__name__}: {e}); fix the template") from None
    return template


class ChatCompletion(api.Completion):
    """A checked chat request: a Completion answered in the chat shape."""
    default_max_tokens = None      # OpenAI's chat API has no default: the rest of the context

    def __init__(self, *args):
        super().__init__(*args)
        self.id = f"chatcmpl-{self.id.removeprefix('cmpl-')}"
        self._opened: set = set()      # choices whose first chunk (the role) has gone

    def _logprobs(self, choice, entries):
        if self.sampling.logprobs is None:
            return None
        return scoring.chat_logprobs(entries, self.tokenizer)

    def chunk(self, index: int, text: str, finish=None, logprobs=()) -> dict:
        delta = {"content": text} if text or not finish else {}
        if index not in self._opened:
            self._opened.add(index)
            delta = {"role": "assistant", **delta}
        out = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
               "model": self.model,
               "choices": [{"index": index, "delta": delta,
                            "logprobs": self._logprobs(None, logprobs) if logprobs else None,
                            "finish_reason": finish}]}
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return dict(super().usage_chunk(prompt_tokens, completion_tokens),
                    object="chat.completion.chunk")

    def response(self, texts, finishes, prompt_tokens: int, completion_tokens: int,
                 logprobs=None) -> dict:
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": c.index,
                             "message": {"role": "assistant", "content": t},
                             "logprobs": self._logprobs(c, logprobs[k] if logprobs else []),
                             "finish_reason": f}
                            for k, (c, t, f) in enumerate(zip(self.choices, texts, finishes))],
                "usage": api.usage(prompt_tokens, completion_tokens)}


def _content(m: dict, i: int) -> str:
    """A message's content: a string, or a list of text parts ({"type": "text", "text"})."""
    where = f"messages[{i}].content"
    c = m.get("content")
    if isinstance(c, str):
        return api._utf8(c, where)
    if (isinstance(c, list) and c and all(isinstance(p, dict) and p.get("type") == "text"
                                          and isinstance(p.get("text"), str) for p in c)):
        return api._utf8("".join(p["text"] for p in c), where)
    raise BadRequest(f"{where} must be a string or a list of text parts "
                     f'({{"type": "text", "text": ...}}), got {json.dumps(c)[:80]}',
                     "messages")


def _messages(v) -> list:
    if v is None:
        raise BadRequest("messages is required: a list of {\"role\", \"content\"} objects",
                         "messages")
    if not isinstance(v, list) or not v:
        raise BadRequest("messages must be a non-empty list of {\"role\", \"content\"} "
                         "objects", "messages")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object with role and content",
                             "messages")
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise BadRequest(f"messages[{i}] has the field {extra[0]!r}, which this server "
                             f"does not take (role, content, name)", "messages")
        role = m.get("role")
        role = ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in ROLES:
            raise BadRequest(f"messages[{i}].role must be one of "
                             f"{', '.join((*ROLES, *ALIASES))}, got {json.dumps(m.get('role'))}",
                             "messages")
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise BadRequest(f"messages[{i}].name must be a string, got {json.dumps(name)}",
                             "messages")
        out.append({"role": role, "content": _content(m, i),
                    **({"name": api._utf8(name, f"messages[{i}].name")}
                       if name is not None else {})})
    return out


def parse_chat(obj: dict, model: str, tokenizer, V: int, cache_len: int, max_batch: int,
               template: Template | None = None) -> ChatCompletion:
    """A chat request's body checked (BadRequest names the first field in error) and its
    messages rendered by template (None: DEFAULT_TEMPLATE) into the prompt."""
    unknown = sorted(set(obj) - _FIELDS)
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r}; this server's chat completions take "
                         f"{', '.join(sorted(_FIELDS))}", unknown[0])
    messages = _messages(obj.get("messages"))
    logprobs = api._bool(obj, "logprobs")
    top = obj.get("top_logprobs")
    if top is not None:
        if not logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        top = api._int(obj, "top_logprobs", 0, low=0, high=scoring.MAX_TOP_LOGPROBS)
    body = {k: obj[k] for k in _SHARED if k in obj}
    limit = "max_tokens"        # the field the request gave the length in
    if obj.get("max_completion_tokens") is not None:
        if obj.get("max_tokens") is not None:
            raise BadRequest("give max_completion_tokens or max_tokens (its older name), not "
                             "both", "max_completion_tokens")
        limit = "max_completion_tokens"
        body["max_tokens"] = api._int(obj, limit, None, low=1)
    body["logprobs"] = (top or 0) if logprobs else None
    try:
        body["prompt"] = (template or _default()).render(messages)
    except Exception as e:           # noqa: BLE001 (the template refuses the conversation)
        raise BadRequest(f"messages: the chat template cannot render this conversation "
                         f"({type(e).__name__}: {e})", "messages") from None
    try:
        return api.parse_completion(body, model, tokenizer, V, cache_len, max_batch,
                                    scoring.MAX_TOP_LOGPROBS, ChatCompletion)
    except BadRequest as e:
        if e.param == "max_tokens" and limit != "max_tokens":     # named as the request did
            raise BadRequest(e.message.replace("max_tokens", limit), limit) from None
        if e.param != "prompt":
            raise
        raise BadRequest(f"messages, through the chat template: {e.message}",
                         "messages") from None


@functools.lru_cache(maxsize=1)
def _default() -> Template:
    """DEFAULT_TEMPLATE, compiled once."""
    return Template(DEFAULT_TEMPLATE)
