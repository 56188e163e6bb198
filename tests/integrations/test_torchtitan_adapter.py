"""The grouped-experts slot of torchtitan-style engines (``experts(x, num_tokens_per_expert)``)
on cakeops, against a plain loop over the experts (torchtitan itself is not installed: its
slot's contract is what is tested)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import cakeops
from cakeops.integrations.torchtitan import grouped_experts, row_experts, use_cakeops_experts

E, D, HIDDEN = 4, 8, 12


class GroupedExperts(torch.nn.Module):
    """A stand-in for torchtitan's module: its parameters, and its for-loop forward."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.num_experts = E
        self.w1 = torch.nn.Parameter(torch.randn(E, HIDDEN, D, generator=g) * 0.3)
        self.w2 = torch.nn.Parameter(torch.randn(E, D, HIDDEN, generator=g) * 0.3)
        self.w3 = torch.nn.Parameter(torch.randn(E, HIDDEN, D, generator=g) * 0.3)

    def forward(self, x, num_tokens_per_expert):
        counts = [int(c) for c in num_tokens_per_expert.tolist()]
        out = x.new_zeros(x.shape)
        start = 0
        for e, n in enumerate(counts):
            rows = x[start : start + n]
            h = F.silu(rows @ self.w1[e].T) * (rows @ self.w3[e].T)
            out[start : start + n] = h @ self.w2[e].T
            start += n
        return out


@pytest.mark.parametrize("counts, padding", [([3, 0, 5, 2], 0), ([0, 4, 1, 0], 3), ([0] * E, 2)])
def test_matches_a_plain_loop(counts, padding):
    """Rows sorted by expert (an expert without rows, padding rows past the counts' sum, float
    counts as ``torch.histc`` gives them): the output and the gradients of x and the three
    weights equal the loop's; padding rows give zeros and get zero gradients."""
    rows = sum(counts) + padding
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, D, generator=g)
    upstream = torch.randn(rows, D, generator=g)
    num = torch.tensor(counts, dtype=torch.float32)
    results = []
    for patched in (False, True):
        module = GroupedExperts()
        if patched:
            assert use_cakeops_experts(torch.nn.Sequential(module)) == 1
        xi = x.clone().requires_grad_()
        out = module(xi, num)
        out.backward(upstream)
        results.append([out, xi.grad, module.w1.grad, module.w2.grad, module.w3.grad])
    for name, got, want in zip(("out", "dx", "dw1", "dw2", "dw3"), *results, strict=True):
        assert cakeops.relative_error(got, want) <= cakeops.tolerance(torch.float32), name
    assert torch.equal(results[1][0][rows - padding :], torch.zeros(padding, D))
    assert torch.equal(results[1][1][rows - padding :], torch.zeros(padding, D))


def test_row_experts_and_the_module_kept():
    """Each row's expert from the counts (``E`` past their sum); the patched module keeps its
    parameters and state-dict names; a wrong count shape is a ValueError naming it."""
    ids = row_experts(torch.tensor([2.0, 0.0, 1.0]), 5)
    assert ids.tolist() == [[0], [0], [2], [3], [3]]
    module = GroupedExperts()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    use_cakeops_experts(module)
    assert module.state_dict().keys() == before.keys()
    with pytest.raises(ValueError, match="num_tokens_per_expert"):
        grouped_experts(torch.randn(3, D), torch.ones(E + 1), module.w1, module.w2, module.w3)


@pytest.mark.parametrize(
    "counts, message",
    [
        ([2, -1, 3, 0], "whole counts >= 0, got -1 for expert 1"),
        ([1.5, 1, 1, 0], "whole counts >= 0, got 1.5 for expert 0"),
        ([1, float("nan"), 0, 0], "whole counts >= 0, got nan for expert 1"),
        ([1, float("inf"), 0, 0], "whole counts >= 0, got inf for expert 1"),
        ([2, 2, 2, 0], "counts summing to at most the 5 rows of x, got a sum of 6"),
    ],
)
def test_counts_the_rows_cannot_hold_are_refused(counts, message):
    """Counts that are negative, fractional or not finite, or that sum past the rows, are a
    ValueError naming the argument (a CPU's; a GPU's with ``CAKEOPS_CHECK_VALUES=1``): they
    misplaced or dropped rows silently."""
    module = GroupedExperts()
    num = torch.tensor(counts, dtype=torch.float32)
    with pytest.raises(ValueError, match=f"'num_tokens_per_expert' expected {message}$"):
        grouped_experts(torch.randn(5, D), num, module.w1, module.w2, module.w3)


def test_patched_module_pickles_and_loads_on_cakeops(tmp_path):
    """A model patched by ``use_cakeops_experts`` and saved whole loads (its forward was a
    bound method, which pickle could not bring back) and still runs on cakeops: here, and in a
    fresh process that imported nothing of cakeops."""
    import pickle
    import subprocess
    import sys

    model = torch.nn.Sequential(GroupedExperts())
    use_cakeops_experts(model)
    x = torch.randn(6, D, generator=torch.Generator().manual_seed(2))
    num = torch.tensor([2.0, 0.0, 3.0, 1.0])
    with torch.no_grad():
        want = model[0](x, num)
    again = pickle.loads(pickle.dumps(model))[0]
    with torch.no_grad():
        torch.testing.assert_close(again(x, num), want, rtol=0, atol=0)
    with cakeops.use_backend("nope", op="routed_experts"), pytest.raises(cakeops.BackendError):
        again(x, num)
    torch.save((model[0], x, num, want), tmp_path / "model.pt")
    script = (
        "import sys, torch\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        f"m, x, num, want = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False)\n"
        "with torch.no_grad():\n"
        "    torch.testing.assert_close(m(x, num), want, rtol=0, atol=0)\n"
        "import cakeops\n"
        "with cakeops.use_backend('nope', op='routed_experts'):\n"
        "    try:\n"
        "        m(x, num)\n"
        "    except cakeops.BackendError:\n"
        "        print('runs on cakeops')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.stdout.strip() == "runs on cakeops", proc.stderr[-3000:]


def test_compiled_whole_checks_the_counts_at_each_call():
    """``torch.compile(fullgraph=True)`` with counts on the CPU traces the slot in one graph
    (the counts' check stopped Dynamo: a data-dependent branch) and still refuses bad counts
    at each call, with the eager error; good counts give the eager output and gradients."""
    torch._dynamo.reset()
    module = GroupedExperts()
    use_cakeops_experts(module)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    x = torch.randn(7, D, generator=torch.Generator().manual_seed(3))
    num = torch.tensor([3.0, 0.0, 2.0, 1.0])
    outs = []
    for run in (module, compiled):
        xi = x.clone().requires_grad_()
        out = run(xi, num)
        out.sum().backward()
        outs.append((out.detach(), xi.grad))
    for got, want in zip(*outs, strict=True):
        assert cakeops.relative_error(got, want) <= cakeops.tolerance(torch.float32)
    for bad, message in (([2.0, -1.0, 3.0, 0.0], "got -1 for expert 1"),
                         ([4.0, 4.0, 0.0, 0.0], "got a sum of 8")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            compiled(x, torch.tensor(bad))
