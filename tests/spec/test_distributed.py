"""Two processes (gloo on the CPU): a model using all three ops under DistributedDataParallel and
under FSDP2 (``fully_shard``) gets the gradients one process computes on the whole batch."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import cakeops
from cakeops.nn import MoEExperts, RMSNormSiLUGate
from cakeops.testing import assert_matches

WORLD = 2
BATCH, L, D, HEADS = 4, 12, 16, 2


class Block(torch.nn.Module):
    """Causal linear attention with a gated-norm output, then an MoE feed-forward."""

    def __init__(self):
        super().__init__()
        self.qkvz = torch.nn.Linear(D, 4 * D, bias=False)
        self.norm = RMSNormSiLUGate(D // HEADS)
        self.out = torch.nn.Linear(D, D, bias=False)
        self.router = torch.nn.Linear(D, 4, bias=False)
        self.moe = MoEExperts(num_experts=4, hidden_size=D, intermediate_size=24, top_k=2)

    def forward(self, x):
        N = x.shape[0]
        q, k, v, z = self.qkvz(x).view(N, L, 4, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        q, k = F.elu(q) + 1, F.elu(k) + 1  # a positive feature map
        a = cakeops.causal_dot_product(q, k, v)
        a = self.norm(a, z).transpose(1, 2).reshape(N, L, D)
        h = x + self.out(a)
        flat = h.reshape(-1, D)
        return h + self.moe(flat, self.router(flat)).view_as(h)


def _model_and_data():
    torch.manual_seed(0)
    model = Block()
    with torch.no_grad():
        for p in model.moe.parameters():
            p.normal_(0, D**-0.5)
    x = torch.randn(BATCH, L, D)
    target = torch.randn(BATCH, L, D)
    return model, x, target


def _loss(model, x, target):
    return F.mse_loss(model(x), target)


def _full_batch_grads():
    model, x, target = _model_and_data()
    _loss(model, x, target).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _worker(rank: int, init_file: str, mode: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        model, x, target = _model_and_data()
        shard = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
        if mode == "ddp":
            wrapped = torch.nn.parallel.DistributedDataParallel(model)
            _loss(wrapped, x[shard], target[shard]).backward()
            grads = {n: p.grad for n, p in model.named_parameters()}
        else:
            from torch.distributed.fsdp import fully_shard

            fully_shard(model.moe)
            fully_shard(model)
            _loss(model, x[shard], target[shard]).backward()
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        if rank == 0:
            torch.save(grads, os.path.join(out_dir, f"{mode}.pt"))
        # Both ranks done before either tears the group down: gloo aborts the process (about one
        # run in three here) when a peer leaves while DDP's last exchange is still in flight.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Done and saved: leave without the interpreter's teardown, whose C++ destructors once
    # aborted a rank here ("terminate called without an active exception": a thread of the
    # process group's or an OpenMP runtime's still joinable at exit), after the test's work.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_data_parallel_gradients_match_one_process(tmp_path, mode):
    mp.spawn(_worker, args=(str(tmp_path / "init"), mode, str(tmp_path)), nprocs=WORLD, join=True)
    got = torch.load(tmp_path / f"{mode}.pt")
    expected = _full_batch_grads()
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        assert_matches(got[name], grad, name, torch.float32)  # the spec's float32 tolerance
