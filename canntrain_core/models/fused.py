"""Wire the kernel registry into transformers' models: norms, RoPE, MLP activation, attention, loss.

``apply_kernels`` swaps the class of each norm, MLP and attention module the model's family lists
(``Family.kernel_modules``: Llama's, Qwen2's, Mistral's, which compute a Llama block) for a
subclass whose ``forward`` calls the ops chosen by the recipe (``model.kernels`` and
``model.kernel_overrides``). Parameters, buffers and state-dict keys stay exactly as they were,
so checkpoints, FSDP and the optimizer see the same model. ``loss_cross_entropy`` returns the
loss op for ``canntrain_core.models.lm.causal_lm_loss``::

    model = build_model(...)
    model = apply_kernels(model, recipe.model)
    cross_entropy = loss_cross_entropy(recipe.model)
    loss = causal_lm_loss(model, input_ids, targets, cross_entropy=cross_entropy)

The fused attention covers training and cached generation; when transformers passes an explicit
mask (padded batches) the stock forward runs instead.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

import canntrain_kernels as kernels
from canntrain_core.errors import RecipeError
from canntrain_core.families import family_of
from canntrain_core.families.family import layer_windows
from canntrain_core.parallel.expert import routed
from canntrain_kernels.registry import Selection

_PRECISION_DTYPES = {"fp32": ("fp32",), "bf16": ("fp32", "bf16"), "fp16": ("fp32", "fp16")}


class FusedRMSNorm(LlamaRMSNorm):
    """LlamaRMSNorm whose forward is the registry's rms_norm."""

    _kernel: Callable

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._kernel(hidden_states, self.weight, self.variance_epsilon)


class FusedLlamaMLP(LlamaMLP):
    """LlamaMLP whose activation silu(gate) * up is the registry's swiglu."""

    _kernel: Callable

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._kernel(self.gate_proj(x), self.up_proj(x)))


class FusedLlamaAttention(LlamaAttention):
    """LlamaAttention with the registry's apply_rotary and attention (causal, GQA, optional window)."""

    _rope: Callable
    _attention: Callable

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if attention_mask is not None:  # padding or a custom mask: the stock path handles it
            return super().forward(hidden_states, position_embeddings, attention_mask, cache, **kwargs)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = self._rope(q, k, cos, sin)
        if cache is not None:  # generation: keys and values so far; queries align with the last ones
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        window = layer_windows(self.config)[self.layer_idx]
        out = self._attention(q, k, v, causal=True, window=window, scale=self.scaling)  # [B, Hq, S, D]
        out = out.transpose(1, 2).reshape(*input_shape, -1).contiguous()
        return self.o_proj(out), None


def _device_type(model: torch.nn.Module, device: str | None) -> str:
    if device is not None:
        return torch.device(device).type
    p = next(model.parameters(), None)
    if p is not None and p.device.type not in ("cpu", "meta"):
        return p.device.type
    return kernels.registry.current_device()


def _config_fields(model_config: Any) -> tuple[str, dict[str, str], str]:
    """(kernels, kernel_overrides, precision) from a recipe ModelConfig or a plain mapping."""
    get = model_config.get if isinstance(model_config, dict) else lambda k, d=None: getattr(model_config, k, d)
    return get("kernels", "eager") or "eager", dict(get("kernel_overrides", {}) or {}), get("precision", "fp32")


def select_kernels(model_config: Any, device: str | None = None) -> dict[str, Selection]:
    """Which backend each op will use for this recipe's ``model`` section on ``device``."""
    default, overrides, precision = _config_fields(model_config)
    device = device or kernels.registry.current_device()
    dtypes = _PRECISION_DTYPES.get(precision, ("fp32",))
    return {op: kernels.select(op, b, device, dtypes) for op, b in kernels.resolve(default, overrides).items()}


def check_kernels_fit(config: Any, model_section: Any, applied: bool = False) -> None:
    """The fused kernels compute a Llama block: SiLU-gated MLP, attention without dropout. A RecipeError
    naming the key otherwise (the trainer asks before any work starts; ``applied``: they are being applied)."""
    eager = getattr(model_section, "kernels", "eager") == "eager" and not getattr(
        model_section, "kernel_overrides", None
    )
    if eager and not applied:
        return  # transformers' own modules run whatever the config says
    chosen_by = f"model.kernels={getattr(model_section, 'kernels', '?')}"
    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise RecipeError(
            f"{chosen_by}: the fused swiglu kernel needs hidden_act silu, the model's config has "
            f"hidden_act {act!r}; use model.kernels=eager (transformers' own MLP)"
        )
    if getattr(config, "attention_dropout", 0.0):
        raise RecipeError(
            f"{chosen_by}: the fused attention has no dropout, the model's config has "
            "attention_dropout > 0; set it to 0 or use model.kernels=eager"
        )


def apply_kernels(model: torch.nn.Module, model_config: Any, device: str | None = None) -> torch.nn.Module:
    """Route the Llama model's norms, RoPE, MLP activation and attention through the kernel registry.

    ``model_config`` is the recipe's ``model`` section (``kernels``, ``kernel_overrides``,
    ``precision``). Returns the same model, changed in place; ``model.canntrain_kernels`` maps
    each op to the :class:`kernels.Selection` made (backend and anything skipped, with reasons).
    Raises :class:`kernels.KernelUnavailable` when a backend named explicitly cannot run here.
    """
    config = getattr(model, "config", None)
    if config is not None:
        check_kernels_fit(config, model_config, applied=True)
    device = _device_type(model, device)
    chosen = select_kernels(model_config, device)
    fns = {op: kernels.registry.kernel(op, sel.backend).fn for op, sel in chosen.items()}
    # the family's modules that compute what the fused ones do (Qwen3's attention, with its per-head norms,
    # is not one of them: it keeps transformers' forward)
    kinds = family_of(config).kernel_modules if config is not None else {}
    used = {"cross_entropy"}  # the loss applies to every family (CausalLM.head_loss)
    for module in model.modules():
        kind = kinds.get(type(module).__name__)
        if kind == "norm":
            module.__class__ = FusedRMSNorm
            module._kernel = fns["rms_norm"]
            used.add("rms_norm")
        elif kind == "mlp":
            module.__class__ = FusedLlamaMLP
            module._kernel = fns["swiglu"]
            used.add("swiglu")
        elif kind == "attention":
            module.__class__ = FusedLlamaAttention
            module._rope, module._attention = fns["apply_rotary"], fns["attention"]
            used |= {"apply_rotary", "attention"}
        elif kind == "experts":  # a mixture of experts: canntrain's routed forward, the experts by the kernel
            routed(module, fns["expert_mlp"])
            used.add("expert_mlp")
    if (kinds or config is None) and used == {"cross_entropy"}:
        raise TypeError(
            f"apply_kernels: no norm, MLP or attention modules the kernels replace in {type(model).__name__}"
        )
    # what this model runs (GPT-2, whose family lists no modules, runs the loss kernel only)
    model.canntrain_kernels = {op: sel for op, sel in chosen.items() if op in used}
    return model


def loss_cross_entropy(model_config: Any, device: str | None = None) -> Callable:
    """The recipe's cross-entropy op: ``fn(hidden [N, h], weight [V, h], targets [N]) -> mean loss``."""
    return kernels.registry.kernel("cross_entropy", select_kernels_for(model_config, "cross_entropy", device)).fn


def ring_block_kernel(model_config: Any, device: str | None = None):
    """The recipe's ``attention_block`` (a context-parallel ring's blocks, ``canntrain_kernels.block_attention``)."""
    return kernels.registry.kernel("attention_block", select_kernels_for(model_config, "attention_block", device)).fn


def select_kernels_for(model_config: Any, op: str, device: str | None = None) -> str:
    """The backend name one op resolves to for this recipe's ``model`` section."""
    default, overrides, precision = _config_fields(model_config)
    requested = kernels.resolve(default, overrides)[op]
    dtypes = _PRECISION_DTYPES.get(precision, ("fp32",))
    return kernels.select(op, requested, device or kernels.registry.current_device(), dtypes).backend


def describe(model: torch.nn.Module) -> str:
    """One line per op: the backend the model uses and why others were skipped."""
    chosen: dict[str, Selection] | None = getattr(model, "canntrain_kernels", None)
    if not chosen:
        return "stock transformers modules (apply_kernels not called)"
    return "\n".join(str(sel) for sel in chosen.values())
