"""The ranks of tests/parallel/test_expert_parallel.py (``main`` on forked local ranks, or this file under torchrun):
expert parallelism's exchange on 2 gloo ranks.

    torchrun --nproc_per_node 2 tests/_ep_ranks.py OUT

Saves OUT/rank<R>.pt: whether dispatch then combine (no experts in between) returned every (token, k) row to
its place, the rows each rank's experts received, and the EP experts' output and input gradient beside
transformers' MixtralExperts on the same full weights (fp64), for a routing that leaves one expert without tokens;
and the same with a capacity of 2 pairs per expert (transformers' experts given the dropped pairs' weights as 0).
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

from canntrain_core.parallel.expert import combine, dispatch, routed, within_capacity


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same weights on both ranks
    config = MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    config._experts_implementation = "eager"  # the loop over experts, as a model built from the config runs it
    theirs = MixtralExperts(config).double()
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.2)
    g = torch.Generator().manual_seed(1 + rank)  # each rank its own tokens and routing
    tokens = 5 + 4 * rank  # uneven
    x = torch.randn(tokens, 16, generator=g, dtype=torch.float64)
    top_k = torch.stack([torch.randperm(3, generator=g)[:2] for _ in range(tokens)])  # expert 3 gets no token
    weights = torch.rand(tokens, 2, generator=g, dtype=torch.float64)

    rows, counts, state = dispatch(x, top_k, 4, dist.group.WORLD)
    back = combine(rows, state, 2 * tokens).view(tokens, 2, 16)
    saved = {"roundtrip": torch.equal(back, x[:, None].expand(-1, 2, -1)), "counts": counts.tolist()}
    keep = within_capacity(top_k, weights, 2, 4)
    rows, counts, state = dispatch(x, top_k, 4, dist.group.WORLD, keep)
    back = combine(rows, state, 2 * tokens).view(tokens, 2, 16)
    saved["dropped_roundtrip"] = torch.equal(back, x[:, None].expand(-1, 2, -1) * keep[..., None])
    saved["kept"], saved["kept_counts"] = keep.sum().item(), counts.tolist()

    ours = MixtralExperts(config).double()
    ours.load_state_dict(theirs.state_dict())
    mine = slice(2 * rank, 2 * rank + 2)  # this rank's two experts
    ours.gate_up_proj = torch.nn.Parameter(theirs.gate_up_proj.detach()[mine].clone())
    ours.down_proj = torch.nn.Parameter(theirs.down_proj.detach()[mine].clone())
    ours.ep_group, ours.capacity_factor = dist.group.WORLD, None
    routed(ours)  # the kernel registry's reference expert_mlp (a loop over this rank's experts)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ours, y_theirs = ours(x1, top_k, weights), theirs(x2, top_k, weights)
    y_ours.square().sum().backward()
    y_theirs.square().sum().backward()
    saved["output_diff"] = (y_ours - y_theirs).abs().max().item()
    saved["input_grad_diff"] = (x1.grad - x2.grad).abs().max().item()
    # the experts' gradient: ep averages over the ranks' tokens, so summed over ranks it is the mean of theirs
    grad = ours.down_proj.grad.clone()
    want = theirs.down_proj.grad.clone()
    dist.all_reduce(want)
    saved["expert_grad_diff"] = (grad - want[mine] / 2).abs().max().item()
    ours.capacity_factor = 2 * 4 / (2 * tokens) - 1e-9  # ceil(f x pairs / 4 experts) = 2, as above
    with torch.no_grad():
        dropped = (ours(x, top_k, weights) - theirs(x, top_k, weights * keep)).abs().max().item()
    saved["dropped_output_diff"] = dropped
    torch.save(saved, Path(out) / f"rank{rank}.pt")
    dist.barrier()  # neither rank tears gloo down while the other is still in its last exchange
    dist.destroy_process_group()
    # Both ranks have saved and torn gloo down; about 1 run in 7 then aborted in C++ static destruction at
    # interpreter exit ("terminate called without an active exception", after "destroyed" was printed): leave
    # without running those destructors.
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
