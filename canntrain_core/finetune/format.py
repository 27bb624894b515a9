"""From a conversation to token ids and the mask of the tokens a loss trains on.

The text comes from the tokenizer's own chat template when the model directory (``model.init_from``)
has one, else from ``data.template`` in the recipe (``data.chat_template`` picks: auto, tokenizer, recipe).
A template that fails (it raises, or renders no conversation as a prefix of a longer one) is a DataError
naming its file. Either way the rendering yields the character
span of every assistant answer; the text is then encoded piece by piece (prompt, answer, prompt, ...)
so that a prompt encodes exactly as it will at generation time, and the mask is exact per token:

- ``train_on: assistant``: every assistant answer (its end-of-turn token included);
- ``train_on: last``: only the final answer;
- ``train_on: all``: every token.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer

from canntrain_core.data.cache import DataError
from canntrain_core.data.tokenizer import chat_template_source
from canntrain_core.finetune.records import Conversation

FALLBACK = "set data.chat_template=recipe to format with data.template instead"


@dataclass(frozen=True)
class Encoded:
    ids: list[int]
    trained: list[bool]  # per token: is it a target of the loss
    prompt_len: int  # tokens before the final answer: what generation starts from


class ChatFormat:
    """``template``: the recipe's data.template (system/user/assistant strings with {content}, {eos});
    ``chat_template``: a transformers tokenizer whose chat template wins when given."""

    def __init__(self, tokenizer: Tokenizer, eos_id: int, template, chat_template=None):
        self.tokenizer, self.eos_id, self.template, self.hf = tokenizer, eos_id, template, chat_template
        self.eos_text = tokenizer.id_to_token(eos_id)

    # ------------------------------------------------------------------ text and answer spans
    def render(self, turns, name: str = "") -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the (start, end) character span of each assistant answer."""
        if self.hf is not None:
            return self._render_hf(turns, name)
        t, text, spans = self.template, "", []
        for role, content in turns:
            if role == "assistant":
                head, tail = t.assistant.split("{content}")
                text += head
                start = len(text)
                text += content + tail.replace("{eos}", self.eos_text)
                spans.append((start, len(text)))
            else:
                text += getattr(t, role).replace("{content}", content)
        return text, spans

    def _render_hf(self, turns, name: str = ""):
        messages = [{"role": r, "content": c} for r, c in turns]
        full = self._apply(messages, False, name)
        spans = []
        for i, (role, _) in enumerate(turns):
            if role != "assistant":
                continue
            before = self._apply(messages[:i], True, name) if i else ""
            through = self._apply(messages[: i + 1], False, name)
            if not (full.startswith(through) and through.startswith(before)):
                raise DataError(
                    f"{self.source}: the chat template does not render a conversation as a prefix of a "
                    f"longer one{_at(name)}, so the answers' tokens cannot be found; {FALLBACK}"
                )
            spans.append((len(before), len(through)))
        return full, spans

    def _apply(self, messages, add_generation_prompt: bool, name: str) -> str:
        try:
            return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # jinja's TemplateError (raise_exception, syntax, undefined) or any error it hit
            why = " ".join(str(e).split()) or type(e).__name__
            raise DataError(f"{self.source}: the chat template fails{_at(name)}: {why}; {FALLBACK}") from None

    @property
    def source(self) -> str:
        """Where the chat template came from (the file), for messages."""
        where = chat_template_source(self.hf.name_or_path) if self.hf is not None and self.hf.name_or_path else None
        return str(where) if where else "the tokenizer's chat template"

    def chat_template(self) -> str | dict | None:
        """The chat template this format renders, for checkpoints and exports: the tokenizer's, or
        ``data.template`` as Jinja (:func:`template_jinja`)."""
        return self.hf.chat_template if self.hf is not None else template_jinja(self.template, self.eos_text)

    def prompt(self, turns) -> list[int]:
        """Token ids that generation starts from after ``turns`` (ending with a user turn), the generation
        prompt included, encoded exactly as the prompt of a training sample."""
        enc = self.encode(Conversation("", (*tuple(turns), ("assistant", "x"))), "last")  # its text never counts
        return enc.ids[: enc.prompt_len]

    # ------------------------------------------------------------------ tokens
    def encode(self, conv: Conversation, train_on: str = "assistant") -> Encoded:
        text, spans = self.render(conv.turns, conv.name)
        keep = spans if train_on == "assistant" else spans[-1:]
        cuts = sorted({0, len(text), *(p for s in spans for p in s)})
        ids: list[int] = []
        trained: list[bool] = []
        prompt_len = 0
        for a, b in zip(cuts, cuts[1:]):
            piece = self.tokenizer.encode(text[a:b], add_special_tokens=False).ids
            if a == spans[-1][0]:
                prompt_len = len(ids)
            ids += piece
            trained += [train_on == "all" or any(s <= a and b <= e for s, e in keep)] * len(piece)
        return Encoded(ids, trained, prompt_len)


def _at(name: str) -> str:
    return f" (record {name})" if name else ""


def _jinja_string(text: str) -> str:
    """``text`` as a Jinja string literal: printable ASCII as is, everything else escaped (Jinja decodes a
    literal's escapes as Python does, and would normalise a raw newline)."""
    out = []
    for ch in text:
        if ch in '\\"':
            out.append("\\" + ch)
        elif " " <= ch <= "~":
            out.append(ch)
        else:
            out.append(f"\\u{ord(ch):04x}" if ord(ch) < 0x10000 else f"\\U{ord(ch):08x}")
    return '"' + "".join(out) + '"'


def template_jinja(template, eos_text: str) -> str:
    """``data.template`` as a Jinja chat template: transformers' ``apply_chat_template`` renders every
    conversation to the text :meth:`ChatFormat.render` gives it (``add_generation_prompt``: the assistant's
    text before its answer), so an exported model is prompted exactly as it was trained."""
    parts = {}
    for role in ("system", "user", "assistant"):
        head, tail = getattr(template, role).split("{content}")
        if role == "assistant":
            tail = tail.replace("{eos}", eos_text)
        parts[role] = (_jinja_string(head), _jinja_string(tail))
    branches = "".join(
        f"{{%- {'if' if i == 0 else 'elif'} message['role'] == '{role}' -%}}\n"
        f"{{{{ {head} + message['content'] + {tail} }}}}\n"
        for i, (role, (head, tail)) in enumerate(parts.items())
    )
    return (
        "{#- canntrain: data.template as a chat template -#}\n"
        "{%- for message in messages -%}\n"
        + branches
        + "{%- else -%}\n{{ raise_exception('data.template has no role ' + message['role']) }}\n"
        "{%- endif -%}\n{%- endfor -%}\n"
        f"{{%- if add_generation_prompt -%}}\n{{{{ {parts['assistant'][0]} }}}}\n{{%- endif -%}}\n"
    )
