"""The harness's ``LM`` interface over a canntrain model: a saved one (``canntrain eval``, through
``jobs/generate.load_generator``) or the trainer's live one (``logging.eval_tasks``), so a run directory or a sharded
DCP checkpoint evaluates as it is, with no export (the harness's own ``HFLM`` needs a transformers model; canntrain's
model is its own class over transformers' blocks, with a ``tokenizers`` tokenizer). ``tests/jobs/test_harness.py``
checks it against ``HFLM`` on the export.

Scoring follows ``HFLM``'s conventions: a continuation's tokens are those of context + continuation past the
context's own (the harness's ``_encode_pair``), no special tokens are added, an empty context is conditioned on the
BOS token (else the end token), and greedy means every continuation token is the argmax.

``chat_prompt``: each request's context becomes the user turn of the model's chat template (what ``canntrain
generate --chat`` encodes and SFT trained on); the harness's own ``--apply_chat_template`` needs a transformers
tokenizer.

Every call is deterministic and makes the same forward passes for the same requests, so the ranks of an FSDP or TP
job that each evaluate the same items stay in lockstep.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from canntrain_core.models.rollout import generate


@dataclass
class ModelView:
    """What the harness needs of a model: its forward (ids in, logits out), tokenizer and end tokens."""

    model: Any  # ids [B, T] -> logits [B, T, V]; models.rollout.generate decodes with it
    tokenizer: Any  # tokenizers.Tokenizer
    eos_id: int
    end_ids: tuple[int, ...]  # every token that ends an answer
    max_length: int  # the model's positions
    chat_prompt: Callable[[str], list[int]] | None = None  # text as a user turn of the chat template, ready to answer


class CanntrainLM(TemplateLM):
    """lm-evaluation-harness's model interface over a :class:`ModelView`; ``batch_size`` rows per forward, for
    scoring and for generation."""

    def __init__(self, view: ModelView, batch_size: int = 8, chat: bool = False):
        super().__init__()
        if chat and view.chat_prompt is None:
            raise ValueError("chat: this model has no chat template")
        self.m, self.batch_size, self.chat = view, batch_size, chat
        self.model_device = next(view.model.parameters()).device

    # ---- tokens ----
    @property
    def eot_token_id(self) -> int:
        return self.m.eos_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.m.tokenizer.token_to_id("<s>") or self.m.tokenizer.token_to_id("<|begin_of_text|>")
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.m.max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.m.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens)).ids

    def tok_decode(self, ids: list[int]) -> str:
        return self.m.tokenizer.decode(ids, skip_special_tokens=False)

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        if not self.chat:
            return super()._encode_pair(context, continuation)
        return self.m.chat_prompt(context), self.tok_encode(continuation)

    # ---- scoring ----
    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(log p(continuation | context), whether it is the greedy continuation) per request, in batches of
        ``batch_size`` rows right-padded to their longest (a causal model's earlier positions ignore the padding)."""
        rows = []
        for _, context, continuation in requests:
            whole = (context + continuation)[-(self.max_length + 1) :]
            rows.append((whole, min(len(continuation), len(whole) - 1)))
        out: list[tuple[float, bool]] = [(0.0, True)] * len(rows)  # an empty continuation: certain, and greedy
        order = sorted((i for i in range(len(rows)) if rows[i][1] > 0), key=lambda i: -len(rows[i][0]))
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            width = max(len(rows[i][0]) for i in batch) - 1
            ids = torch.full((len(batch), width), self.eot_token_id, dtype=torch.long)
            for j, i in enumerate(batch):
                ids[j, : len(rows[i][0]) - 1] = torch.tensor(rows[i][0][:-1])
            logits = self.m.model(ids.to(self.model_device))
            for j, i in enumerate(batch):
                whole, n = rows[i]
                span = slice(len(whole) - 1 - n, len(whole) - 1)  # the positions that predict the continuation
                # fp32 over the continuation's positions only, not the batch's [rows, width, vocab]
                logp = torch.log_softmax(logits[j, span].float(), dim=-1)
                target = torch.tensor(whole[-n:], device=logp.device)
                picked = logp.gather(-1, target[:, None]).squeeze(-1)
                out[i] = (float(picked.sum()), bool((logp.argmax(-1) == target).all()))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """A document's log-likelihood over windows of the model's length (perplexity tasks), as ``HFLM`` cuts them."""
        totals = []
        for (text,) in (r.args for r in requests):
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    self.tok_encode(text), self.prefix_token_id, self.max_length, context_len=1
                )
            ]
            scored = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows])
            totals.append(sum(lp for lp, _ in scored))
        return totals

    # ---- generation ----
    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations (the harness's default; ``do_sample`` is not taken), each cut at the first of its
        ``until`` strings, at most ``max_gen_toks`` tokens: requests with the same limits decoded together,
        ``batch_size`` left-padded prompts at a time, longest first."""
        todo = []
        for i, (context, kwargs) in enumerate(r.args for r in requests):
            until = kwargs.get("until") or []
            until = (until,) if isinstance(until, str) else tuple(until)
            max_new = int(kwargs.get("max_gen_toks", 256))
            ids = self.m.chat_prompt(context) if self.chat else self.tok_encode(context)
            todo.append((max_new, until, ids[-max(1, self.max_length - max_new) :], i))
        answers = [""] * len(todo)
        todo.sort(key=lambda x: (x[0], x[1], -len(x[2])))
        for start in range(0, len(todo), self.batch_size):
            group = todo[start : start + self.batch_size]
            for max_new, until in dict.fromkeys((g[0], g[1]) for g in group):  # each limits' share of the batch
                same = [g for g in group if (g[0], g[1]) == (max_new, until)]
                rows = generate(self.m.model, [g[2] for g in same], max_new, self.m.eos_id, 0.0, 0, self.m.end_ids)
                for (_, _, _, i), row in zip(same, rows):
                    end = next((k for k, t in enumerate(row) if t in self.m.end_ids), len(row))
                    text = self.tok_decode(row[:end])
                    for stop in until:
                        text = text.split(stop)[0]
                    answers[i] = text
        return answers
