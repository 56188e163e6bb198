"""Expert parallelism (``cakeops.distributed.routed_experts``) with gloo on the CPU, 2 and 4
processes: output and every gradient equal to the single-process op on the gathered problem;
composed with FSDP2 on a small model's other parameters."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import cakeops
from cakeops import distributed as cd
from cakeops._spec import relative_error
from cakeops.testing import assert_matches

T, D, FF, E, K = 6, 8, 12, 8, 2  # tokens per rank, hidden, intermediate, experts, top-k
GRADS = ("out", "x", "top_k_weights", "w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")
#: form -> the op's options (the biases, when given, are part of the problem)
FORMS = {"swiglu": {}, "gpt-oss": {"alpha": 1.702, "limit": 0.8, "up_offset": 1.0}}


def problem(world: int, biases: bool):
    """The gathered problem: every rank's tokens, every expert, some dropped slots."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(world * T, D, generator=g)
    index = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(world * T)])
    index[::5, 1] = E + 3  # dropped slots (ids >= E)
    index[2::5, 0] = -1  # dropped (DeepEP's "not on this rank")
    weights = torch.softmax(torch.randn(world * T, K, generator=g), -1)
    shapes = [(E, FF, D), (E, FF, D), (E, D, FF)] + ([(E, FF), (E, FF), (E, D)] if biases else [])
    experts = [torch.randn(s, generator=g) * 0.3 for s in shapes]
    return x, index, weights, experts, torch.randn(world * T, D, generator=g)


def _call(op, x, index, weights, experts, options):
    w_gate, w_up, w_down, *b = experts
    biases = dict(zip(("b_gate", "b_up", "b_down"), b, strict=False))
    return op(x, index, weights, w_gate, w_up, w_down, **biases, **options)


def _leave():
    """Leave the worker without the interpreter's teardown (see test_distributed.py)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _worker(rank: int, world: int, init: str, out: str, form: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    x, index, weights, experts, g = problem(world, form != "swiglu")
    mine, block = slice(rank * T, (rank + 1) * T), E // world
    leaves = [x[mine], weights[mine], *(t[rank * block : (rank + 1) * block] for t in experts)]
    leaves = [t.clone().requires_grad_() for t in leaves]
    y = _call(cd.routed_experts, leaves[0], index[mine], leaves[1], leaves[2:], FORMS[form])
    y.backward(g[mine])
    torch.save([y.detach(), *(t.grad for t in leaves)], f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()
    _leave()


@pytest.mark.parametrize("world, form", [(2, "swiglu"), (4, "gpt-oss")])
def test_matches_the_single_process_op(tmp_path, world, form):
    """Each rank's output and ``x``/``top_k_weights`` gradients are its rows of the gathered
    op's; its expert weights' and biases' gradients are its block of the gathered op's."""
    out = str(tmp_path / "rank")
    mp.spawn(_worker, args=(world, str(tmp_path / "init"), out, form), nprocs=world, join=True)
    parts = [torch.load(f"{out}.{r}") for r in range(world)]
    got = [torch.cat(values) for values in zip(*parts, strict=True)]
    x, index, weights, experts, g = problem(world, form != "swiglu")
    leaves = [t.double().requires_grad_() for t in (x, weights, *experts)]
    ref = _call(cakeops.routed_experts, leaves[0], index, leaves[1], leaves[2:], FORMS[form])
    want = [ref, *torch.autograd.grad(ref, leaves, g.double())]
    assert len(got) == len(want)
    for name, a, b in zip(GRADS, got, want, strict=False):
        assert_matches(a, b, name, torch.float32)


def _wire_worker(rank: int, world: int, init: str, out: str) -> None:
    """Forward and backward of the 2-rank problem, recording each exchange of rows of D."""
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    sent = []
    exchange = cd._all_to_all

    def recorded(rows, split_in, split_out, group):
        # rows leaving this rank, and the bytes of one
        sent.append((sum(split_in) - split_in[rank], rows[0].numel() * rows.element_size()))
        return exchange(rows, split_in, split_out, group)

    cd._all_to_all = recorded
    # the counts' exchange: started, the rows gathered meanwhile, then waited for
    events = []
    counts_exchange, gather = dist.all_to_all_single, cd._gather_rows

    def counts(*args, async_op=False, **kwargs):
        work = counts_exchange(*args, async_op=async_op, **kwargs)
        events.append(("counts", async_op))
        if not async_op:
            return work

        class Recorded:  # (a Work's wait cannot be replaced)
            def wait(self, *a):
                events.append("wait")
                return work.wait(*a)

        return Recorded()

    def gathered(*args):
        events.append("gather")
        return gather(*args)

    cd.dist.all_to_all_single, cd._gather_rows = counts, gathered
    x, index, weights, experts, g = problem(world, False)
    mine, block = slice(rank * T, (rank + 1) * T), E // world
    leaves = [t.clone().requires_grad_() for t in (x[mine], weights[mine])]
    local = [t[rank * block : (rank + 1) * block] for t in experts]
    cd.routed_experts(leaves[0], index[mine], leaves[1], *local).backward(g[mine])
    cd.dist.all_to_all_single = counts_exchange
    torch.save((sent, events), f"{out}.{rank}")
    dist.destroy_process_group()
    _leave()


def _whole(n: int, to: int) -> int:
    return -(-n // to) * to


@pytest.mark.timeout(300)
def test_a_token_crosses_once_per_rank(tmp_path):
    """A token goes once to each other rank that holds one of its experts, whatever how many
    of its slots are there (it went once per slot): the four exchanges of rows (tokens out,
    partial sums back, then in the backward the partial sums' gradients out and the tokens'
    back) each carry exactly those pairs, and there is no other (a token's slots' ids and
    weights travel in its row's exchange, their gradients too). The counts' exchange runs while
    the rank gathers its rows."""
    world = 2
    out = str(tmp_path / "rank")
    mp.spawn(_wire_worker, args=(world, str(tmp_path / "init"), out), nprocs=world, join=True)
    _, index, _, _, _ = problem(world, False)
    owner = torch.where(index < E, index // (E // world), -1)  # each slot's rank (-1: dropped)
    home = torch.arange(world * T) // T
    for rank in range(world):
        others = home != rank
        # (token, rank) pairs leaving this rank, and arriving at it
        away = sum(int((owner[home == rank] == r).any(1).sum()) for r in range(world) if r != rank)
        received = int((others & (owner == rank).any(1)).sum())
        slots_away = int(((owner[home == rank] != rank) & (owner[home == rank] >= 0)).sum())
        sent, events = torch.load(f"{out}.{rank}")
        assert events[:3] == [("counts", True), "gather", "wait"], events
        assert [n for n, _ in sent] == [away, received, away, received], sent
        # float32 rows; int32 ids and float32 weights packed beside a token's, a row's
        # gradient beside its weights' (a packed row padded to 64 bytes)
        row, token, grads = D * 4, _whole(D * 4 + K * (4 + 4), 64), _whole(D * 4 + K * 4, 64)
        assert [b for _, b in sent] == [token, row, row, grads], sent
        assert away < slots_away  # the problem has tokens with two slots on one rank


def _edge_problem(case: str):
    """The gathered problem of an edge case, each rank's token rows and expert blocks:
    ``empty`` (rank 1 has no tokens), ``uneven`` (E = 5 as blocks of 3 and 2), ``bfloat16``
    (the problem in bfloat16, larger, NaN weights on dropped slots)."""
    g = torch.Generator().manual_seed(2)
    n, experts, dtype = {"empty": (7, E, torch.float32), "uneven": (6, 5, torch.float32),
                         "bfloat16": (48, E, torch.bfloat16)}[case]  # fmt: skip
    x = torch.randn(n, D, generator=g)
    index = torch.stack([torch.randperm(experts, generator=g)[:K] for _ in range(n)])
    index[::5, 1] = experts + 3
    weights = torch.softmax(torch.randn(n, K, generator=g), -1)
    weights[::5, 1] = float("nan")  # on the dropped slots: adds nothing
    shapes = [(experts, FF, D), (experts, FF, D), (experts, D, FF)]
    w = [torch.randn(s, generator=g) * 0.3 for s in shapes]
    upstream = torch.randn(n, D, generator=g)
    half = n if case == "empty" else n // 2
    rows = [slice(0, half), slice(half, n)]
    cut = 3 if case == "uneven" else E // 2
    blocks = [slice(0, cut), slice(cut, experts)]
    cast = lambda t: t.to(dtype)  # noqa: E731
    return (cast(x), index, cast(weights), [cast(t) for t in w], cast(upstream)), rows, blocks


def _edge_worker(rank: int, init: str, out: str, case: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    (x, index, weights, experts, g), rows, blocks = _edge_problem(case)
    mine, block = rows[rank], blocks[rank]
    leaves = [x[mine], weights[mine], *(t[block] for t in experts)]
    leaves = [t.clone().requires_grad_() for t in leaves]
    try:
        y = _call(cd.routed_experts, leaves[0], index[mine], leaves[1], leaves[2:], {})
        y.backward(g[mine])
        torch.save([y.detach(), *(t.grad for t in leaves)], f"{out}.{rank}")
    except ValueError as exc:
        torch.save(str(exc), f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()
    _leave()


def _run_edge(tmp_path, case: str):
    out = str(tmp_path / "rank")
    mp.spawn(_edge_worker, args=(str(tmp_path / "init"), out, case), nprocs=2, join=True)
    return [torch.load(f"{out}.{r}") for r in range(2)]


def _single(problem, dtype=torch.float64):
    x, index, weights, experts, g = problem
    leaves = [t.to(dtype).requires_grad_() for t in (x, weights, *experts)]
    ref = _call(cakeops.routed_experts, leaves[0], index, leaves[1], leaves[2:], {})
    return [ref.detach(), *torch.autograd.grad(ref, leaves, g.to(dtype))]


@pytest.mark.timeout(300)
def test_a_rank_without_tokens(tmp_path):
    """A rank with no tokens (the last micro-batch, an empty shard) takes part, forward and
    backward: its output is empty, and the other rank's results and every expert gradient are
    the single-process op's (it crashed in the combine, and the other rank waited in the
    backward's exchange until gloo aborted it)."""
    parts = _run_edge(tmp_path, "empty")
    assert parts[1][0].shape == (0, D) and parts[1][1].shape == (0, D)
    got = [torch.cat(values) for values in zip(*parts, strict=True)]
    want = _single(_edge_problem("empty")[0])
    for name, a, b in zip(GRADS, got, want, strict=False):
        assert_matches(a, b, name, torch.float32)


@pytest.mark.timeout(300)
def test_uneven_expert_blocks_are_refused(tmp_path):
    """E = 5 over 2 ranks as 3 + 2: every rank raises a ValueError naming the blocks (the
    expert gradients were 27-39% off, silently), and none waits for the other."""
    for message in _run_edge(tmp_path, "uneven"):
        assert isinstance(message, str), message
        assert message.startswith("distributed.routed_experts: argument 'w_up' expected the same "
                                  "number of experts on every rank"), message  # fmt: skip
        assert "[3, 2]" in message, message


@pytest.mark.timeout(300)
def test_bfloat16_combines_in_float32(tmp_path):
    """bfloat16: the combine and its gradients in float32, as the single-process op's, so the
    distributed op's error against float64 is that op's own, give or take the one rounding of
    each slot's output (it was 2-3.6x: every slot and product rounded to bfloat16); NaN weights
    on dropped slots reach nothing."""
    problem = _edge_problem("bfloat16")[0]
    got = [torch.cat(values) for values in zip(*_run_edge(tmp_path, "bfloat16"), strict=True)]
    single = _single(problem, torch.bfloat16)
    want = _single(problem)
    for name, a, b, c in zip(GRADS, got, want, single, strict=False):
        assert torch.isfinite(a).all(), name
        err, own = relative_error(a, b), relative_error(c, b)
        assert err <= 1.5 * own, f"{name}: {err:.3g} against the single-process op's {own:.3g}"


#: case -> what rank 1 changes in its call, and the error every rank raises: the argument and
#: the ranks' values, or (a "refused" case) rank 1's own error from the single-process op's
#: checks and the others' pointing at it
DISAGREEMENTS = {
    "width": (lambda c: c.update(x=torch.randn(T, 2 * D), w_gate=torch.randn(E // 2, FF, 2 * D),
                                 w_up=torch.randn(E // 2, FF, 2 * D),
                                 w_down=torch.randn(E // 2, 2 * D, FF)), "x", "width D", "[8, 16]"),
    "dtype": (lambda c: c.update(x=c["x"].bfloat16()), "x", "dtype", "bfloat16"),
    "slots": (lambda c: c.update(index=c["index"][:, :1], weights=c["weights"][:, :1]),
              "top_k_index", "number of slots k", "[2, 1]"),
    "gate": (lambda c: c.update(w_gate=None), "w_gate", "presence", "[True, False]"),
    "bias": (lambda c: c.update(b_up=torch.zeros(E // 2, FF)), "b_up", "presence",
             "[False, True]"),
    "activation": (lambda c: c.update(activation="gelu"), "activation", "value",
                   "['silu', 'gelu']"),
    "limit": (lambda c: c.update(limit=7.0), "limit", "value", "[inf, 7.0]"),
    "gradient": (lambda c: c.update(x=c["x"].detach(), weights=c["weights"].detach()), "x",
                 "need of a gradient", "[True, False]"),
    "refused-option": (lambda c: c.update(activation="bogus"), "activation", None,
                       "expected one of"),
    "refused-id": (lambda c: c["index"].__setitem__((0, 0), -5), "top_k_index", None,
                   "got -5"),
}  # fmt: skip


def _disagree_worker(rank: int, init: str, out: str) -> None:
    """Every case of :data:`DISAGREEMENTS` in turn in one process group, then a call both ranks
    make alike: the errors, and whether that call still runs (no rank left in an exchange)."""
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(rank)

    def call(case, group=None):
        c = {"x": torch.randn(T, D, generator=g).requires_grad_(),
             "index": torch.randint(0, E, (T, K), generator=g),
             "weights": torch.softmax(torch.randn(T, K, generator=g), -1).requires_grad_(),
             "w_gate": torch.randn(E // 2, FF, D, generator=g).requires_grad_(),
             "w_up": torch.randn(E // 2, FF, D, generator=g).requires_grad_(),
             "w_down": torch.randn(E // 2, D, FF, generator=g).requires_grad_()}  # fmt: skip
        if case is not None and rank == 1:
            DISAGREEMENTS[case][0](c)
        options = {k: c.pop(k) for k in list(c) if k not in ("x", "index", "weights", "w_gate",
                                                              "w_up", "w_down")}  # fmt: skip
        return cd.routed_experts(c["x"], c["index"], c["weights"], c["w_gate"], c["w_up"],
                                 c["w_down"], group=group, **options)  # fmt: skip

    errors = {}
    for case in DISAGREEMENTS:
        try:
            call(case)
            errors[case] = None
        except (ValueError, TypeError) as exc:
            errors[case] = str(exc)
    alone = dist.new_group([0])
    if rank == 1:
        with pytest.raises(ValueError, match="'group' expected a process group this rank belongs "
                           "to, got one without global rank 1"):  # fmt: skip
            call(None, alone)
    y = call(None)
    y.sum().backward()
    torch.save((errors, torch.isfinite(y).all().item()), f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()
    _leave()


@pytest.mark.timeout(300)
def test_ranks_that_disagree_all_raise_the_same_error(tmp_path):
    """A rank whose call differs from the others' in what the exchange or the experts' form
    depend on, or whose arguments the single-process op refuses, makes every rank raise, naming
    the argument and each rank's value, and leaves the group usable. Before: a width apart
    aborted the process, a dtype or k apart read the rows as garbage (k: silently), a gate,
    bias or activation apart gave a token rank-dependent experts, an id of -5 was dropped
    silently, and a rank refused alone or recording no backward left the others waiting. A rank
    outside the group it passes is told so (it raised an IndexError)."""
    out = str(tmp_path / "rank")
    mp.spawn(_disagree_worker, args=(str(tmp_path / "init"), out), nprocs=2, join=True)
    (errors0, finite0), (errors1, finite1) = (torch.load(f"{out}.{r}") for r in range(2))
    assert finite0 and finite1
    for case, (_, name, what, shown) in DISAGREEMENTS.items():
        first, second = errors0[case], errors1[case]
        assert first is not None and second is not None, case
        if what is None:  # rank 1's own error, the other rank's pointing at it
            assert second.startswith(f"routed_experts: argument '{name}'"), (case, second)
            assert shown in second, (case, second)
            pointing = ("distributed.routed_experts: the arguments of rank(s) [1] were refused "
                        "(each raised why there): no rank runs the call")  # fmt: skip
            assert first == pointing, first
        else:
            assert first == second, case
            assert first.startswith(f"distributed.routed_experts: argument '{name}' expected "
                                    f"the same {what}"), (case, first)  # fmt: skip
            assert shown in first, (case, first)


class Model(torch.nn.Module):
    """A projection, a router and the experts (this rank's block under expert parallelism),
    then an output projection."""

    def __init__(self, world: int = 1, rank: int = 0):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(D, D)
        self.router = torch.nn.Linear(D, E, bias=False)
        self.out = torch.nn.Linear(D, D)
        block = slice(rank * E // world, (rank + 1) * E // world)
        full = [torch.randn(s) * 0.3 for s in ((E, FF, D), (E, FF, D), (E, D, FF))]
        self.experts = torch.nn.ParameterList([torch.nn.Parameter(w[block]) for w in full])
        self.world = world

    def forward(self, x):
        h = self.inp(x)
        weights, index = torch.topk(torch.softmax(self.router(h), -1), K, dim=-1)
        op = cakeops.routed_experts if self.world == 1 else cd.routed_experts
        return self.out(h + op(h, index, weights, *self.experts))


def _fsdp_worker(rank: int, world: int, init: str, out: str, how: str) -> None:
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = Model(world, rank)
    for part in (model.inp, model.router, model.out):  # FSDP2 on everything but the experts
        fully_shard(part)
    if how == "hook":
        cd.average_expert_grads(model.experts)
        with pytest.raises(ValueError, match="an earlier call set up"):  # it divided again
            cd.average_expert_grads(model.experts)
    x, target = _data(world)
    mine = slice(rank * T, (rank + 1) * T)
    F.mse_loss(model(x[mine]), target[mine]).backward()
    if how == "by hand":
        cd.scale_expert_grads(model.experts.parameters())
    else:
        with pytest.raises(ValueError, match="parameters average_expert_grads set up"):
            cd.scale_expert_grads(model.experts.parameters())
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
             for n, p in model.named_parameters()}  # fmt: skip
    torch.save(grads, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()
    _leave()


def _data(world: int):
    g = torch.Generator().manual_seed(1)
    return torch.randn(world * T, D, generator=g), torch.randn(world * T, D, generator=g)


@pytest.mark.parametrize("how", ["hook", "by hand"])
def test_composes_with_fsdp2(tmp_path, how):
    """FSDP2 shards and averages the other parameters; the experts are sharded by expert
    parallelism, their gradients averaged by ``average_expert_grads``' hooks (set once) or by
    ``scale_expert_grads`` after the backward: every gradient equals the one process's on the
    whole batch."""
    world, out = 2, str(tmp_path / "rank")
    mp.spawn(_fsdp_worker, args=(world, str(tmp_path / "init"), out, how), nprocs=world,
             join=True)  # fmt: skip
    parts = [torch.load(f"{out}.{r}") for r in range(world)]
    model = Model()
    x, target = _data(world)
    F.mse_loss(model(x), target).backward()
    for name, p in model.named_parameters():
        if name.startswith("experts."):
            got = torch.cat([part[name] for part in parts])
        else:
            got = parts[0][name]
            assert torch.equal(got, parts[1][name]), name
        assert_matches(got, p.grad.double(), name, torch.float32)


def _load_example():
    """``docs/examples/expert_parallel_2d.py`` as a module (its ``Experts``: this rank's block
    of experts behind a forward, what FSDP2 shards and gathers around)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("expert_parallel_2d", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "docs", "examples", "expert_parallel_2d.py")
Experts = _load_example().Experts


class MeshModel(Model):
    """:class:`Model` with its experts a module: block ``ep_rank`` of ``ep`` over ``group``."""

    def __init__(self, ep: int = 1, ep_rank: int = 0, group=None):
        super().__init__()
        block = slice(ep_rank * E // ep, (ep_rank + 1) * E // ep)
        self.experts = Experts([w.detach()[block] for w in self.experts], group)

    def forward(self, x):
        h = self.inp(x)
        weights, index = torch.topk(torch.softmax(self.router(h), -1), K, dim=-1)
        return self.out(h + self.experts(h, index, weights))


def _mesh_worker(rank: int, world: int, init: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    # 2-D: expert-FSDP x EP; the experts' blocks over "ep", each block sharded over "efsdp"
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("efsdp", "ep"))
    ep = mesh["ep"]
    model = MeshModel(ep.size(), ep.get_local_rank(), ep.get_group())
    cd.average_expert_grads(model.experts, ep.get_group(), fsdp_mesh=mesh["efsdp"])
    for part in (model.inp, model.router, model.out):  # FSDP2 over every rank
        fully_shard(part)
    x, target = _data(world)
    mine = slice(rank * T, (rank + 1) * T)
    F.mse_loss(model(x[mine]), target[mine]).backward()
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
             for n, p in model.named_parameters()}  # fmt: skip
    torch.save((ep.get_local_rank(), grads), f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()
    _leave()


def test_a_2d_mesh_averages_through_fsdp_s_divide_factor(tmp_path):
    """4 ranks as a 2-D mesh (expert-FSDP 2 x EP 2): the experts' blocks over EP, each block
    ``fully_shard``-ed over expert-FSDP by ``average_expert_grads``, whose divide factor (4)
    makes FSDP's own reduce-scatter average the experts' gradients over every rank, with
    nothing called after the backward; the other parameters FSDP2 over all 4: every gradient
    equals the one process's on the whole batch."""
    world, out = 4, str(tmp_path / "rank")
    mp.spawn(_mesh_worker, args=(world, str(tmp_path / "init"), out), nprocs=world, join=True)
    parts = [torch.load(f"{out}.{r}") for r in range(world)]
    model = MeshModel()
    x, target = _data(world)
    F.mse_loss(model(x), target).backward()
    blocks = {}
    for ep_rank, grads in parts:
        blocks.setdefault(ep_rank, grads)
    for name, p in model.named_parameters():
        expert = name.startswith("experts.")
        for ep_rank, grads in parts:  # the same on every rank (of a block, for the experts)
            assert torch.equal(grads[name], (blocks[ep_rank] if expert else parts[0][1])[name])
        got = torch.cat([blocks[b][name] for b in sorted(blocks)]) if expert else parts[0][1][name]
        assert_matches(got, p.grad.double(), name, torch.float32)


def test_refuses_without_a_process_group():
    x = torch.randn(4, D)
    index = torch.zeros(4, K, dtype=torch.long)
    w = [torch.randn(1, FF, D), torch.randn(1, FF, D), torch.randn(1, D, FF)]
    with pytest.raises(RuntimeError, match="not initialised"):
        cd.routed_experts(x, index, torch.ones(4, K), *w)


def _hf_worker(rank: int, world: int, init: str, path: str, out: str) -> None:
    # transformers reads the ranks from the environment; the group is ours, made first
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    import transformers as tf
    from transformers.distributed import DistributedConfig

    import cakeops.integrations.transformers  # noqa: F401 (registers "cakeops")

    calls = []
    dispatch = cd.routed_experts

    def counted(*args, **kwargs):
        calls.append(1)
        return dispatch(*args, **kwargs)

    cd.routed_experts = counted  # how many layers ran cakeops' dispatcher
    results = {}
    for impl, ep in (("eager", "auto"), ("cakeops", "auto"), ("eager", "cakeops")):
        calls.clear()
        config = DistributedConfig(ep_size=world, fsdp_size=world, tp_size=1, ep_implementation=ep)
        model = tf.AutoModelForCausalLM.from_pretrained(
            path, distributed_config=config, experts_implementation=impl
        )
        ids = _hf_tokens(rank)
        output = model(ids, labels=ids)
        output.loss.backward()
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                 for n, p in model.named_parameters() if p.grad is not None}  # fmt: skip
        forwards = len(calls)
        # three AdamW steps from there: the losses they reach
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(3):
            optimizer.step()
            optimizer.zero_grad()
            loss = model(ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
        key = impl if ep == "auto" else f"ep_implementation={ep}"
        results[key] = (output.loss.detach(), grads, forwards, output.logits.detach(),
                        torch.stack(losses))  # fmt: skip
    torch.save(results, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()
    _leave()


def _hf_tokens(rank: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(rank))


def test_transformers_expert_parallelism(tmp_path):
    """transformers' own expert parallelism (``DistributedConfig(ep_size=2)``, its all-to-all
    dispatch, FSDP2 on the rest) runs on gloo: with ``experts_implementation="cakeops"``, and
    with cakeops' dispatcher as its EP implementation (``ep_implementation="cakeops"``), each
    rank's logits, loss, every gradient and the losses of 3 AdamW steps equal those with the
    eager experts and transformers' dispatch, and the logits and loss are the single-process
    model's on that rank's batch."""
    sys.path.insert(0, os.path.dirname(__file__))
    import hf_families as H

    model = H.build_model(H.family("qwen3_moe"))
    model.save_pretrained(tmp_path / "model")
    world, out, init = 2, str(tmp_path / "rank"), str(tmp_path / "init")
    mp.spawn(_hf_worker, args=(world, init, str(tmp_path / "model"), out), nprocs=world, join=True)
    model.set_experts_implementation("eager")
    model.eval()
    for rank in range(world):
        results = torch.load(f"{out}.{rank}")
        loss, grads, _, logits, steps = results["eager"]
        single = model(_hf_tokens(rank), labels=_hf_tokens(rank))
        assert_matches(logits, single.logits.detach().double(), "logits", torch.float32)
        single = single.loss.detach()
        assert results["cakeops"][2] == 0 and results["ep_implementation=cakeops"][2] == 2
        for key in ("cakeops", "ep_implementation=cakeops"):
            loss_c, grads_c, _, logits_c, steps_c = results[key]
            assert_matches(logits_c, logits.double(), f"{key}: logits", torch.float32)
            assert_matches(steps_c, steps.double(), f"{key}: losses of 3 AdamW steps",
                           torch.float32)  # fmt: skip
            assert not torch.allclose(steps_c[-1], loss_c)  # the steps changed the model
            assert_matches(loss_c, single.double(), f"{key}: loss against one process",
                           torch.float32)  # fmt: skip
            assert_matches(loss_c, loss.double(), f"{key}: loss", torch.float32)
            assert grads.keys() == grads_c.keys() and grads
            for name, grad in grads.items():
                assert_matches(grads_c[name], grad.double(), f"{key}: {name}", torch.float32)


def _hf_allreduce_worker(rank: int, world: int, init: str, path: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    import transformers as tf
    from transformers.distributed import DistributedConfig

    from cakeops.integrations.transformers import experts

    seen = []  # per experts call: whether a slot was dropped (an id past the local experts)
    run = experts.routed_experts

    def spy(x, index, weights, w_gate, w_up, w_down, **kwargs):
        seen.append(bool((index >= w_down.shape[0]).any()))
        return run(x, index, weights, w_gate, w_up, w_down, **kwargs)

    experts.routed_experts = spy
    results = {}
    for impl in ("eager", "cakeops"):
        config = DistributedConfig(tp_size=world, ep_size=world)
        model = tf.AutoModelForCausalLM.from_pretrained(
            path, distributed_config=config, experts_implementation=impl
        )
        model.eval()
        with torch.no_grad():
            results[impl] = model(_hf_tokens(0)).logits
    results["sentinels"] = seen
    torch.save(results, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()
    _leave()


def test_transformers_allreduce_ep_hands_the_experts_sentinels(tmp_path):
    """transformers' ``AllReduceEP`` (``tp_size == ep_size``, inference: every rank runs its
    experts on the whole batch, the routes to other ranks' experts given the local id
    ``num_local_experts`` and weight 0) with ``experts_implementation="cakeops"``: the experts
    receive those sentinel ids (recorded) and drop them; each rank's logits equal the eager
    experts' and the single-process model's."""
    sys.path.insert(0, os.path.dirname(__file__))
    import hf_families as H

    model = H.build_model(H.family("qwen3_moe"))
    model.save_pretrained(tmp_path / "model")
    world, out, init = 2, str(tmp_path / "rank"), str(tmp_path / "init")
    mp.spawn(_hf_allreduce_worker, args=(world, init, str(tmp_path / "model"), out),
             nprocs=world, join=True)  # fmt: skip
    model.set_experts_implementation("eager")
    model.eval()
    with torch.no_grad():
        single = model(_hf_tokens(0)).logits.double()
    for rank in range(world):
        results = torch.load(f"{out}.{rank}")
        assert results["sentinels"] and all(results["sentinels"])
        assert_matches(results["eager"], single, "eager logits", torch.float32)
        assert_matches(results["cakeops"], single, "cakeops logits", torch.float32)


def test_benchmark_reports_both_configurations(tmp_path):
    """``python -m cakeops.bench.expert_parallel --quick``: one process, and the two layouts
    (a token once per rank, a row per slot before #38); bytes sent by the expert-parallel ranks
    only, counted at the exchanges, equal to the count from the routing (rows of float32 D out
    and back, forward and backward; int32 ids and float32 weights per slot packed beside a token
    row, in rows padded to 64 bytes, with the token layout; an int64 id and a weight per row
    with the slot layout; the weights' gradients back);
    at top-4 of 16 experts over 2 ranks the token layout sends at most 0.55x the bytes."""
    from cakeops.bench import expert_parallel as bench

    rows = bench.run(quick=True)
    one, tokens, slots = rows
    assert one["sent"] == 0 and one["time_s"] > 0
    assert tokens["time_s"] > 0 and slots["time_s"] > 0
    T, D, _, E, k = next(iter(bench.QUICK_CASES.values()))
    _, index, *_ = bench.problem(*next(iter(bench.QUICK_CASES.values())))
    owner = index // (E // 2)
    home = torch.arange(T).unsqueeze(1) // (T // 2)
    want = {"tokens": [], "slots": []}
    for rank in range(2):
        mine, others = home[:, 0] == rank, home[:, 0] != rank
        away_pairs = int((owner[mine] != rank).any(1).sum())
        received_pairs = int((owner[others] == rank).any(1).sum())
        away_slots = int((owner[mine] != rank).sum())
        received_slots = int((owner[others] == rank).sum())
        # a token's row with its ids and weights packed (64-byte rows), its partial sum's
        # gradient back; a partial sum out, its row's and weights' gradients packed back
        token, grads = _whole(4 * D + 8 * k, 64), _whole(4 * D + 4 * k, 64)
        want["tokens"].append(away_pairs * (token + 4 * D) + received_pairs * (4 * D + grads))
        want["slots"].append(away_slots * (8 * D + 12) + received_slots * (8 * D + 4))
    assert tokens["sent"] == max(want["tokens"]) and slots["sent"] == max(want["slots"])
    assert tokens["sent"] <= 0.55 * slots["sent"]
    text = bench.markdown(rows, quick=True)
    assert "2 processes x 1 thread" in text and "python -m cakeops.bench.expert_parallel" in text


def test_the_2d_mesh_example_runs():
    """``python docs/examples/expert_parallel_2d.py``: 4 gloo processes, expert-FSDP x EP,
    three SGD steps reaching the one-process losses (the example checks them)."""
    import subprocess

    done = subprocess.run([sys.executable, EXAMPLE], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the same" in done.stdout


@pytest.mark.parametrize(
    "dtypes",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float64, torch.float64),
        (torch.bfloat16, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("n", [0, 3])
def test_rows_ids_and_weights_travel_packed(dtypes, n):
    """A pair's row, ids and weights side by side in one buffer of bytes, each part aligned
    (the token's row first, padded to 16 bytes, then the widest dtype first; a row padded to 64
    bytes, so the token rows read back have a stride of whole 16-element tiles) and read back
    as a view of it, whatever the dtypes and an odd width."""
    D, k = 7, 3
    x = torch.randn(n, D).to(dtypes[0])
    ids = torch.randint(0, 9, (n, k), dtype=torch.int32)
    w = torch.rand(n, k).to(dtypes[1])
    packed = cd._packed(x, ids, w)
    assert packed.dtype == torch.uint8 and packed.shape[1] % 64 == 0
    assert packed.shape[1] - (D * x.element_size() + k * (4 + w.element_size())) < 16 + 64
    parts = cd._unpacked(packed, [(x.dtype, D), (ids.dtype, k), (w.dtype, k)])
    assert parts[0].stride(0) * x.element_size() == packed.shape[1]
    for got, want in zip(parts, (x, ids, w), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
        assert got.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()
