"""From a conversation to token ids and the mask of the tokens a loss trains on.

The text comes from the tokenizer's own chat template when the model directory (``model.init_from``)
has one, else from ``data.template`` in the recipe. Either way the rendering yields the character
span of every assistant answer; the text is then encoded piece by piece (prompt, answer, prompt, ...)
so that a prompt encodes exactly as it will at generation time, and the mask is exact per token:

- ``train_on: assistant``: every assistant answer (its end-of-turn token included);
- ``train_on: last``: only the final answer;
- ``train_on: all``: every token.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer

from canntrain_core.finetune.records import Conversation


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
    def render(self, turns) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the (start, end) character span of each assistant answer."""
        if self.hf is not None:
            return self._render_hf(turns)
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

    def _render_hf(self, turns):
        messages = [{"role": r, "content": c} for r, c in turns]
        full = self.hf.apply_chat_template(messages, tokenize=False)
        spans = []
        for i, (role, _) in enumerate(turns):
            if role != "assistant":
                continue
            before = self.hf.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
            through = self.hf.apply_chat_template(messages[: i + 1], tokenize=False)
            if not (full.startswith(through) and through.startswith(before)):
                raise ValueError("the tokenizer's chat template does not render a conversation as a prefix of a "
                                 "longer one; give data.template in the recipe instead")
            spans.append((len(before), len(through)))
        return full, spans

    # ------------------------------------------------------------------ tokens
    def encode(self, conv: Conversation, train_on: str = "assistant") -> Encoded:
        text, spans = self.render(conv.turns)
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
