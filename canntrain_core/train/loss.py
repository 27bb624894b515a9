"""The language-model loss, owned here (not inside transformers) so a fused kernel can replace it.

The cross-entropy ops take final hidden states [N, h], the output projection [V, h] and targets [N];
``kernels.reference.plain_cross_entropy`` is the definition, kernels' chunked one never builds the
full fp32 logits. The loss itself is computed by CausalLM's forward (see models/lm.py).
"""

from __future__ import annotations

from canntrain_kernels.reference import plain_cross_entropy


def causal_lm_loss(model, input_ids, targets, cross_entropy=plain_cross_entropy):
    """Mean next-token loss of a transformers *ForCausalLM on already-shifted targets
    (targets[t] = input_ids[t+1]); the same computation the trainer's CausalLM runs."""
    from canntrain_core.models.lm import CausalLM

    return CausalLM(model, cross_entropy)(input_ids, targets)
