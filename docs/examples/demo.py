"""The main job: train a tiny hybrid sequence model whose blocks use three of the six ops.

Each block is causal linear attention (a positive feature map, ``causal_dot_product`` for the
numerator and the normaliser, a gated RMSNorm on the heads with ``rmsnorm_silu_gate``) followed
by an MoE feed-forward (a router and ``moe_experts``), both residual, under activation
checkpointing. The task is multi-query associative recall (MQAR), generated on the fly: a
sequence of key-value pairs, then some of the keys again; at each repeated key the model must
name its value. The attention's keys also see the previous token (a token shift, as recall
models with linear attention use): at a value, the key is the token before it, so the state maps
each key to its value in one step. It fails (exit 1) unless the loss falls by at least a third
and the query accuracy on held-out sequences reaches 0.9; with matplotlib installed it saves the
loss and accuracy curve as a PNG and prints where.

Afterwards a few steps run again from the same weights with each installed backend as the first
choice, side by side: loss, largest gradient difference from the ``torch`` backend, time per step,
and under each row which backend ran each op (``torch`` where the first choice cannot, and why).

``CAKEOPS_BACKEND=name python docs/examples/demo.py`` (or ``nox -s demo``) trains on that backend.
"""

from __future__ import annotations

import copy
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import cakeops
from cakeops import registry

KEYS, VALUES, PAIRS, QUERIES = 16, 16, 6, 6
VOCAB = KEYS + VALUES
SEQ = 2 * PAIRS + QUERIES
DIM, HEADS, EXPERTS, TOP_K, LAYERS = 64, 2, 4, 2, 2
STEPS, BATCH, LR = 300, 32, 3e-3
HELD_OUT, MIN_ACCURACY = 1024, 0.9
CURVE = os.path.join(os.environ.get("OUT", "bench-results"), "demo-curve.png")


def mqar_batch(batch: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``k1 v1 ... kP vP q1 ... qQ`` and targets (-100 except at the queries)."""
    keys = torch.stack([torch.randperm(KEYS, generator=generator)[:PAIRS] for _ in range(batch)])
    values = torch.randint(KEYS, VOCAB, (batch, PAIRS), generator=generator)
    pick = torch.stack([torch.randperm(PAIRS, generator=generator)[:QUERIES] for _ in range(batch)])
    tokens = torch.cat([torch.stack([keys, values], -1).flatten(1), keys.gather(1, pick)], dim=1)
    targets = torch.full_like(tokens, -100)
    targets[:, 2 * PAIRS :] = values.gather(1, pick)
    return tokens, targets


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = DIM // HEADS
        self.attn_norm = torch.nn.RMSNorm(DIM)
        self.qkvz = torch.nn.Linear(DIM, 4 * DIM, bias=False)
        self.k_prev = torch.nn.Linear(DIM, DIM, bias=False)  # the keys' view of the token before
        self.gated_norm = cakeops.nn.RMSNormSiLUGate(self.head)
        self.out = torch.nn.Linear(DIM, DIM, bias=False)
        self.ffn_norm = torch.nn.RMSNorm(DIM)
        self.router = torch.nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = cakeops.nn.MoEExperts(EXPERTS, DIM, 2 * DIM, TOP_K)
        with torch.no_grad():
            for w in self.experts.parameters():
                w.normal_(0, w.shape[-1] ** -0.5)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        N, L, _ = x.shape
        q, k, v, z = self.qkvz(x).view(N, L, 4, HEADS, self.head).permute(2, 0, 3, 1, 4)
        before = F.pad(x[:, :-1], (0, 0, 1, 0))  # token shift: position t sees token t - 1
        k = k + self.k_prev(before).view(N, L, HEADS, self.head).transpose(1, 2)
        q, k = F.elu(q) + 1, F.elu(k) + 1  # positive features: a well-defined normaliser
        num = cakeops.causal_dot_product(q, k, v)
        den = cakeops.causal_dot_product(q, k, torch.ones_like(v[..., :1]))
        a = self.gated_norm(num / (den + 1e-6), z)
        return self.out(a.transpose(1, 2).reshape(N, L, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attn_norm(x))
        h = self.ffn_norm(x).reshape(-1, DIM)
        return x + self.experts(h, self.router(h)).view_as(x)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.pos = torch.nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = torch.nn.RMSNorm(DIM)
        self.lm_head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos
        for block in self.blocks:  # activation checkpointing: only the block inputs are kept
            x = checkpoint(block, x, use_reentrant=False)
        return self.lm_head(self.norm(x))


def loss_and_accuracy(model, tokens, targets) -> tuple[torch.Tensor, float]:
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    asked = targets != -100
    accuracy = (logits.argmax(-1)[asked] == targets[asked]).float().mean().item()
    return loss, accuracy


#: when the last progress line went to a log (not a terminal)
_logged = {"at": 0.0}


def progress(step: int, total: int, loss: float, accuracy: float, start: float) -> None:
    """A progress bar with the rate and the time left, redrawn in place on a terminal; in a log
    a line every 5 seconds (and at the end)."""
    now = time.perf_counter()
    rate = step / max(now - start, 1e-9)
    done = int(30 * step / total)
    bar = "#" * done + "." * (30 - done)
    line = (f"  [{bar}] {step:4d}/{total}  {rate:5.1f} steps/s  {(total - step) / rate:4.0f} s "
            f"left  loss {loss:.3f}  acc {accuracy:.2f}")  # fmt: skip
    if sys.stdout.isatty():
        print(f"\r{line}", end="" if step < total else "\n", flush=True)
    elif now - _logged["at"] >= 5.0 or step == total:
        _logged["at"] = now
        print(line, flush=True)


def held_out_accuracy(model: Model) -> float:
    """Query accuracy on ``HELD_OUT`` fresh sequences from a generator training never used."""
    tokens, targets = mqar_batch(HELD_OUT, torch.Generator().manual_seed(12345))
    with torch.no_grad():
        return loss_and_accuracy(model, tokens, targets)[1]


def save_curve(history: list[tuple[int, float, float]]) -> str | None:
    """The loss and accuracy curve as a PNG at ``CURVE``; ``None`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps, losses, accuracies = zip(*history, strict=True)
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(9, 3.2), dpi=110)
    ax_loss.plot(steps, losses)
    ax_loss.set(xlabel="step", ylabel="training loss (smoothed)", yscale="log")
    ax_acc.plot(steps, accuracies)
    ax_acc.axhline(1 / VALUES, color="grey", linestyle="--", linewidth=0.8, label="chance")
    ax_acc.set(xlabel="step", ylabel="query accuracy (batch)", ylim=(0, 1.02))
    ax_acc.legend(loc="lower right", fontsize=8)
    fig.suptitle("cakeops demo: MQAR on a hybrid linear-attention + MoE model", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(CURVE) or ".", exist_ok=True)
    fig.savefig(CURVE)
    plt.close(fig)
    return CURVE


def train(model: Model) -> tuple[float, float, float, list[tuple[int, float, float]]]:
    generator = torch.Generator().manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / STEPS))
    )
    first = last = accuracy = float("nan")
    smooth = None
    history = []
    start = time.perf_counter()
    for step in range(1, STEPS + 1):
        tokens, targets = mqar_batch(BATCH, generator)
        loss, accuracy = loss_and_accuracy(model, tokens, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        smooth = loss.item() if smooth is None else 0.9 * smooth + 0.1 * loss.item()
        if step == 1:
            first = loss.item()
        history.append((step, smooth, accuracy))
        if step % 10 == 0 or step == STEPS:
            progress(step, STEPS, smooth, accuracy, start)
    last = smooth
    return first, last, accuracy, history


def op_calls(model: Model) -> list[tuple[str, tuple, dict]]:
    """Each op the model calls, with inputs of the model's shapes (for ``cakeops.explain``)."""
    tokens, _ = mqar_batch(2, torch.Generator().manual_seed(0))
    h = model.embed(tokens).reshape(-1, DIM)
    block = model.blocks[0]
    q = torch.rand(2, HEADS, SEQ, DIM // HEADS)
    return [
        ("rmsnorm_silu_gate", (q, q, block.gated_norm.weight), {}),
        ("causal_dot_product", (q, q, q), {}),
        ("moe_experts", (h, block.router(h), *block.experts.parameters()), {"top_k": TOP_K}),
    ]


def backend_table(model: Model, steps: int = 3) -> None:
    """A few steps from the same weights with each installed backend first in the preference
    list, against ``torch``: where a backend cannot run an op here, ``torch`` does, and the
    line under its row says which backend ran each op, and why."""
    generator = torch.Generator().manual_seed(2)
    batches = [mqar_batch(BATCH, generator) for _ in range(steps)]
    calls = op_calls(model)
    results, ran = {}, {}
    names = sorted(registry.backends(), key=lambda n: n != "torch")  # torch first: the baseline
    for name, backend in ((n, registry.backends()[n]) for n in names):
        reason = backend.unavailable_reason()
        if reason is not None:
            results[name] = reason
            continue
        preference = name if name == "torch" else f"{name},torch"
        with cakeops.use_backend(preference):
            ran[name] = []
            for op, args, kwargs in calls:
                explanation = cakeops.explain(getattr(cakeops, op), *args, **kwargs)
                why = "; ".join(explanation.reasons.get(name, []))
                note = "" if explanation.backend == name else f" ({name}: {why})"
                ran[name].append(f"{op} on {explanation.backend}{note}")
            replica = copy.deepcopy(model)
            loss_and_accuracy(replica, *batches[0])[0].backward()  # warm-up: compiles, caches
            losses, start = [], time.perf_counter()
            for tokens, targets in batches:
                replica.zero_grad(set_to_none=True)
                loss, _ = loss_and_accuracy(replica, tokens, targets)
                loss.backward()
                losses.append(loss.item())
        grads = {n: p.grad.detach().clone() for n, p in replica.named_parameters()}
        results[name] = (sum(losses) / steps, grads, (time.perf_counter() - start) / steps)
    base = results.get("torch")
    print(
        f"\n  {'first choice':<12} {'loss':>8} {'max |grad - torch|':>19} {'ms/step':>8}"
        "   (torch runs the ops the first choice cannot run here)"
    )
    for name, r in results.items():
        if isinstance(r, str):
            print(f"  {name:<12} {'-':>8} {'-':>19} {'-':>8}  (unavailable: {r})")
            continue
        loss, grads, seconds = r
        diff = "-"
        if isinstance(base, tuple):
            diff = f"{max((grads[n] - base[1][n]).abs().max().item() for n in grads):.2e}"
        print(f"  {name:<12} {loss:8.4f} {diff:>19} {seconds * 1e3:8.1f}")
        for line in ran[name]:
            print(f"      {line}")


def main() -> int:
    torch.manual_seed(0)
    forced = os.environ.get("CAKEOPS_BACKEND")
    print(
        f"cakeops demo: MQAR ({PAIRS} pairs, {QUERIES} queries, {KEYS} keys, {VALUES} values), "
        f"{LAYERS} hybrid blocks, {STEPS} steps of {BATCH}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    if forced:
        print(f"CAKEOPS_BACKEND={forced}: every op runs on that choice")
    model = Model()
    for op, args, kwargs in op_calls(model):
        print(f"  {op:<20} -> {cakeops.explain(getattr(cakeops, op), *args, **kwargs).backend}")
    reference = copy.deepcopy(model)
    start = time.perf_counter()
    first, last, accuracy, history = train(model)
    seconds = time.perf_counter() - start
    held_out = held_out_accuracy(model)
    print(
        f"first loss {first:.3f}, last loss {last:.3f} (smoothed), query accuracy {accuracy:.2f} "
        f"on the last batch, {held_out:.2f} on {HELD_OUT} held-out sequences "
        f"(chance {1 / VALUES:.2f}), {seconds:.0f} s"
    )
    curve = save_curve(history)
    print(f"curve: {curve}" if curve else "curve: not drawn (pip install matplotlib)")
    backend_table(reference)
    if not last <= first * (2 / 3):
        print(f"FAILED: the loss fell from {first:.3f} to {last:.3f}, less than a third")
        return 1
    if held_out < MIN_ACCURACY:
        print(f"FAILED: held-out query accuracy {held_out:.2f}, below {MIN_ACCURACY}")
        return 1
    print(f"ok: the loss fell by more than a third and held-out accuracy is {held_out:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
