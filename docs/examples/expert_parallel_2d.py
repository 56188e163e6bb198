"""Expert parallelism on a 2-D mesh (expert-FSDP x EP) with FSDP2, on CPU processes (gloo).

Each rank holds a block of the experts (EP); each block is itself sharded by FSDP2 over the
expert-FSDP ranks; every other parameter is sharded by FSDP2 over all ranks.
``cakeops.distributed.average_expert_grads`` sets FSDP's own gradient divide factor on the
experts, so that their gradients are the average over every rank like the others', with nothing
to call after a backward. Three SGD steps reach the losses of the same model trained in one
process on the whole batch (checked at the end).

    python docs/examples/expert_parallel_2d.py                        # spawns 4 processes
    torchrun --nproc-per-node 4 docs/examples/expert_parallel_2d.py   # or under torchrun
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import cakeops
import cakeops.distributed as cd

D, FF, E, K, T = 16, 32, 8, 2, 12  # hidden, intermediate, experts, top-k, tokens per rank
STEPS, LR = 3, 0.5


class Experts(torch.nn.Module):
    """A block of experts; over an EP ``group``, this rank's (None: all of them, one process)."""

    def __init__(self, weights: list[torch.Tensor], group: dist.ProcessGroup | None = None):
        super().__init__()
        self.w_gate, self.w_up, self.w_down = (torch.nn.Parameter(w) for w in weights)
        self.group = group

    def forward(self, h, index, weights):
        w = (self.w_gate, self.w_up, self.w_down)
        if self.group is None:
            return cakeops.routed_experts(h, index, weights, *w)
        return cd.routed_experts(h, index, weights, *w, group=self.group)


class Model(torch.nn.Module):
    """A projection, a router, the experts and an output projection (block ``rank`` of
    ``blocks`` of the experts)."""

    def __init__(self, blocks: int = 1, rank: int = 0, group: dist.ProcessGroup | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(D, D)
        self.router = torch.nn.Linear(D, E, bias=False)
        self.out = torch.nn.Linear(D, D)
        full = [torch.randn(s) * 0.3 for s in ((E, FF, D), (E, FF, D), (E, D, FF))]
        mine = slice(rank * E // blocks, (rank + 1) * E // blocks)
        self.experts = Experts([w[mine] for w in full], group)

    def forward(self, x):
        h = self.inp(x)
        weights, index = torch.topk(torch.softmax(self.router(h), -1), K, dim=-1)
        return self.out(h + self.experts(h, index, weights))


def data(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(world * T, D, generator=gen), torch.randn(world * T, D, generator=gen)


def train(rank: int, world: int, init: str) -> list[float]:
    """``STEPS`` SGD steps on this rank's tokens; the mean loss over the ranks at each step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("efsdp", "ep"))
    ep = mesh["ep"]
    model = Model(ep.size(), ep.get_local_rank(), ep.get_group())
    cd.average_expert_grads(model.experts, ep.get_group(), fsdp_mesh=mesh["efsdp"])
    for part in (model.inp, model.router, model.out):
        fully_shard(part)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, target = data(world)
    mine = slice(rank * T, (rank + 1) * T)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x[mine]), target[mine])
        loss.backward()
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    dist.destroy_process_group()
    return losses


def one_process(world: int) -> list[float]:
    """The same model and steps in one process on the whole batch."""
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, target = data(world)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def worker(rank: int, world: int, init: str) -> None:
    losses = train(rank, world, init)
    if rank == 0:
        alone = one_process(world)
        print("losses, 2-D mesh:  ", " ".join(f"{v:.6f}" for v in losses))
        print("losses, one process:", " ".join(f"{v:.6f}" for v in alone))
        tol = cakeops.tolerance(torch.float32)  # the reductions run in another order
        ok = all(abs(a - b) <= tol * max(1.0, abs(b)) for a, b in zip(losses, alone, strict=True))
        print("the same" if ok else "DIFFERENT")
        sys.stdout.flush()
        if not ok:
            os._exit(1)
    sys.stdout.flush()
    os._exit(0)  # past gloo's teardown, which may wait on the other processes


if __name__ == "__main__":
    torch.set_num_threads(1)
    if "RANK" in os.environ:  # under torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(4, f"file://{tmp}/init"), nprocs=4, join=True)
