"""CausalLM: runs a family model's parts (embed -> layers -> norm -> head -> loss) itself: transformers' Llama,
Qwen and Mistral trees, or canntrain's GPT-2 tree of the same names (``models/gpt2.py``).

Why not call LlamaForCausalLM.forward? Three reasons, all from parallel training:
- FSDP2 and DDP hook the *root* module's forward, so the loss must be computed inside it;
- a pipeline stage keeps only its own layers (a ModuleDict keyed by the original index, so
  parameter names, and with them checkpoints, are the same on every layout);
- the loss takes final hidden states and the head's weight, so a chunked cross-entropy never
  materialises the full fp32 logits.
Parameter names equal transformers' (``model.layers.3.mlp.up_proj.weight``, ``lm_head.weight``).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from canntrain_core.families import family_of
from canntrain_core.families.family import layer_windows
from canntrain_core.models.moe import RouterRecorder, dropped_tokens, expert_tokens, load_balancing_loss
from canntrain_core.parallel.vocab import vocab_parallel_cross_entropy, vocab_sharded
from canntrain_kernels.reference import plain_cross_entropy


class CausalLM(nn.Module):
    def __init__(self, hf_model: nn.Module, cross_entropy: Callable = plain_cross_entropy):
        super().__init__()
        self.config = hf_model.config
        self.model = hf_model.model  # LlamaModel: embed_tokens, layers, norm, rotary_emb (GPT-2: embed_positions)
        self.lm_head = hf_model.lm_head
        self.cross_entropy = cross_entropy
        self.windows = layer_windows(self.config)  # each layer's sliding window (None: none)
        family = family_of(self.config)
        self.routers = RouterRecorder(self.model, family.router_class) if family.router_class else None  # MoE
        if self.routers is not None:
            self.experts = getattr(self.config, family.config_key("num_experts"))
            self.top_k = getattr(self.config, family.config_key("experts_per_token"))
        self.aux_loss: torch.Tensor | None = None  # the last training forward's load-balancing loss (unscaled)
        self.expert_tokens: torch.Tensor | None = None  # and its [layers, experts] routed token counts
        self.dropped_tokens: torch.Tensor | None = None  # and per layer the assignments over capacity
        self.capacity_factor: float | None = None  # the experts' (set by parallel.expert.route_experts)
        self.context_parallel = None  # a parallel.context.ContextParallel (set by apply_context_parallel)

    def layers(self):
        layers = self.model.layers
        return layers.values() if isinstance(layers, nn.ModuleDict) else layers

    def forward(
        self,
        x: torch.Tensor,
        targets: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        context_parallel: bool = False,
    ) -> torch.Tensor:
        """Token ids (or, on a later pipeline stage, hidden states) in; loss, logits or hidden states out.

        With ``targets`` (-100 where nothing is trained): the mean next-token loss over the trained
        targets. Without: logits, or hidden states when this module is a pipeline stage without the
        head. ``position_ids`` / ``segment_ids``: packed instruction rows (positions restart per sample,
        attention stays within a sample). ``attention_mask`` ([B, 1, q, k] bool) with ``cache`` (transformers'
        ``DynamicCache``): incremental decoding of left-padded prompts (``models.rollout``). ``context_parallel``:
        the inputs (and ``position_ids``, ``segment_ids``) are this rank's slices of the rows
        (``ContextParallel.split_batch``); attention runs over the cp group.
        """
        m = self.model
        if self.routers is not None:  # what an earlier pass (evaluation, recompute in backward) recorded
            self.routers.take()
        # Positions from the input, which always holds the whole sequence (under sequence parallel
        # the embedding's output is only this rank's slice of it).
        positions = position_ids if position_ids is not None else torch.arange(x.shape[1], device=x.device)[None]
        mask = attention_mask  # None: SDPA applies the causal mask itself
        cp = self.context_parallel
        if cp is not None:  # ring attention masks by global position and segment itself
            context_parallel = context_parallel or cp.pipelined  # a stage's schedule passes its inputs alone
            cp.begin(context_parallel, segment_ids)
            segment_ids = None if context_parallel else segment_ids
            if context_parallel and position_ids is None:
                positions = cp.stage_positions(x.shape[1], x.device)
        if segment_ids is not None:  # block-diagonal causal: a token sees earlier tokens of its own sample
            same = segment_ids[:, :, None] == segment_ids[:, None, :]
            mask = (same & torch.ones_like(same[0], dtype=torch.bool).tril())[:, None]
        h = x
        if m.embed_tokens is not None:  # the first pipeline stage
            h = m.embed_tokens(x)
            learned = getattr(m, "embed_positions", None)  # GPT-2's learned absolute positions
            if learned is not None:
                h = m.drop(h + learned(positions))
        rope = m.rotary_emb(h, position_ids=positions) if m.rotary_emb is not None else None
        masks = {None: mask}  # by window: a sliding window adds a band to the mask
        layers = m.layers.items() if isinstance(m.layers, nn.ModuleDict) else enumerate(m.layers)
        for i, layer in layers:
            window = self.windows[int(i)]
            if window not in masks:
                masks[window] = window_mask(mask, x.shape[1], window, x.device)
            h = layer(h, attention_mask=masks[window], position_ids=positions, position_embeddings=rope, cache=cache)
        if self.lm_head is None:
            return h
        h = m.norm(h)
        if isinstance(h, DTensor):  # sequence parallel: gather the sequence for the head and loss
            h = h.full_tensor()
        if targets is not None:
            loss = self.head_loss(h, targets)
            return loss + self._router_loss() if self.routers is not None and self.training else loss
        # A pipeline's last stage hands its final hidden states to the schedule's loss (head_loss).
        return h if self.pipeline_last_stage else self.lm_head(h)

    def _router_loss(self) -> torch.Tensor:
        """router_aux_loss_coef x the load-balancing loss of this forward's routing (kept in ``aux_loss``, each
        layer's tokens per expert in ``expert_tokens``, those over the experts' capacity in ``dropped_tokens``)."""
        logits = self.routers.take()
        self.expert_tokens = expert_tokens([x.detach() for x in logits], self.experts, self.top_k)
        if self.capacity_factor is not None:
            tokens = logits[0].shape[0]
            self.dropped_tokens = dropped_tokens(self.expert_tokens, tokens, self.top_k, self.capacity_factor)
        aux = load_balancing_loss(logits, self.expert_tokens)
        self.aux_loss = aux.detach()
        return self.config.router_aux_loss_coef * aux

    pipeline_last_stage = False  # set by parallel.pp.split_stage
    # Instruction data under a pipeline: the trainer sets a weight so that the schedule's mean of
    # micro-batch losses becomes the mean over the step's trained tokens (see Trainer._token_weights).
    token_weight: float | None = None

    def head_loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean next-token loss of final hidden states: the recipe's cross-entropy kernel, on every
        layout (a pipeline's schedule calls this as its loss function)."""
        weight = self.lm_head.weight
        if vocab_sharded(weight):  # TP with distributed.vocab_parallel: no rank builds the whole logits
            loss = vocab_parallel_cross_entropy(h.flatten(0, 1), weight, targets.flatten())
        else:
            loss = self.cross_entropy(h.flatten(0, 1), weight, targets.flatten())
        if self.token_weight is not None:
            loss = loss * (targets != -100).sum() * self.token_weight
        return loss


def window_mask(mask: torch.Tensor | None, q_len: int, window: int, device) -> torch.Tensor | None:
    """``mask`` ([B, 1, q, k] bool, or None for plain causal) with a sliding window: query i (the last q of k
    keys) sees key j only when i - window < j, as transformers' sliding-window masks. Unchanged while every
    key is within the window."""
    k_len = mask.shape[-1] if mask is not None else q_len
    if k_len <= window:
        return mask
    i = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    j = torch.arange(k_len, device=device)[None]
    band = (j > i - window) & (j <= i)
    return band[None, None] if mask is None else mask & band


def causal_lm_loss(model, input_ids, targets, cross_entropy=plain_cross_entropy):
    """Mean next-token loss of a transformers *ForCausalLM on already-shifted targets
    (targets[t] = input_ids[t+1]); the same computation the trainer's CausalLM runs."""
    return CausalLM(model, cross_entropy)(input_ids, targets)
