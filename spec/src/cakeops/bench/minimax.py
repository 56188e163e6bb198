"""MiniMax's lightning-attention layer (transformers' ``MiniMaxLightningAttention``) as Hugging
Face runs it and with its core on cakeops (``apply_cakeops``): a training step (forward+backward)
of a prefill, and a 32-token decode from the cached state.

    python -m cakeops.bench.minimax [--quick] [--device cuda] [--markdown PATH]

The core is what cakeops replaces: Hugging Face's loop over 256-position blocks (and its
per-token loop when decoding) against one :func:`cakeops.causal_dot_product` with ``log_decay``.
Its time is the layer's minus the time of the same layer with the core taken out (the
projections, norm and gate alone), all timed in alternation in one run. Needs
``cakeops[transformers]`` (exits with status 2 without it).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from cakeops.bench.tables import format_table
from cakeops.bench.timing import measure
from cakeops.measure import alternating_times

#: (L, heads, head size) of the training step; the layer's hidden size is heads x head size
SHAPE = (4096, 8, 128)
QUICK_SHAPE = (512, 2, 32)
DECODE_TOKENS = 32
NO_TRANSFORMERS = 2


def layers(heads: int, head_dim: int, device, dtype):
    """The Hugging Face layer and a copy on cakeops (same weights; :func:`without_core` takes
    the copy's core out)."""
    import transformers as tf

    from cakeops.integrations import transformers as integration

    config = tf.MiniMaxConfig(hidden_size=heads * head_dim, num_attention_heads=heads,
                              head_dim=head_dim, num_hidden_layers=2, block_size=256,
                              layer_types=["linear_attention", "full_attention"])  # fmt: skip
    torch.manual_seed(0)
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    hf = MiniMaxLightningAttention(config, layer_idx=0).to(device, dtype)
    ours = integration.apply_cakeops(copy.deepcopy(hf))
    return hf, ours


@contextlib.contextmanager
def without_core():
    """The cakeops layer's core replaced by nothing (its output is ``v``): what is left is the
    rest of the layer, the same in both."""
    from cakeops.integrations.transformers import linear_attention

    def nothing(q, k, v, *, initial_state=None, **_):
        N, H, _, E = q.shape
        state = torch.zeros(N, H, E, v.shape[-1], dtype=torch.float32, device=v.device)
        return v, state

    real = linear_attention.causal_dot_product
    linear_attention.causal_dot_product = nothing
    try:
        yield
    finally:
        linear_attention.causal_dot_product = real


def train_contenders(hf, ours, x, g):
    params = {"Hugging Face layer": hf, "cakeops layer": ours, "layer without its core": ours}
    contenders = {}
    for label, layer in params.items():
        context = without_core if label == "layer without its core" else contextlib.nullcontext

        def forward(layer=layer, context=context):
            with context():
                return layer(x, None, None)[0]

        def step(forward=forward, layer=layer):
            wrt = (x, *layer.parameters())
            return torch.autograd.grad(forward(), wrt, g)

        contenders[label] = (forward, step)
    return contenders


def decode_steps(layer, x, tokens: int):
    """A prefill of ``x`` into a cache, then ``tokens`` single-token steps from it (timed)."""
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    with torch.no_grad():
        cache = MiniMaxCache()
        layer(x, None, None, cache=cache)
        state = cache.get_linear_cache(layer.layer_idx)
        steps = torch.randn(tokens, x.shape[0], 1, x.shape[2], generator=torch.Generator()
                            .manual_seed(1)).to(x.device, x.dtype)  # fmt: skip

    def run():
        with torch.no_grad():
            cache.set_linear_cache(layer.layer_idx, state.clone())
            for t in range(tokens):
                layer(steps[t], None, None, cache=cache)

    return run


def run(quick: bool = False, device: torch.device | str = "cpu") -> dict[str, Any]:
    device = torch.device(device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    L, heads, head_dim = QUICK_SHAPE if quick else SHAPE
    hf, ours = layers(heads, head_dim, device, dtype)
    x = torch.randn(1, L, heads * head_dim, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(1, L, heads * head_dim, device=device, dtype=dtype)
    results = measure(train_contenders(hf, ours, x, g), device, repeats=2 if quick else 5)
    title = f"\nMiniMax lightning attention, fwd+bwd, L {L}, {heads} heads of {head_dim}"
    print(format_table(title, results, "Hugging Face layer"))
    rest = results["layer without its core"]["time_s"]
    core = {name: results[f"{name} layer"]["time_s"] - rest for name in ("Hugging Face", "cakeops")}
    hf_core, our_core = core["Hugging Face"], core["cakeops"]
    print(f"  the core (layer minus the layer without it): Hugging Face {hf_core * 1e3:.1f} ms, "
          f"cakeops {our_core * 1e3:.1f} ms: {hf_core / our_core:.2f}x")  # fmt: skip
    prefix = x.detach()
    decode = {"Hugging Face layer": decode_steps(hf, prefix, DECODE_TOKENS),
              "cakeops layer": decode_steps(ours, prefix, DECODE_TOKENS)}  # fmt: skip
    times = alternating_times(decode, device, repeats=3 if quick else 7, warmup=1)
    decode_s = {label: statistics.median(t) for label, t in times.items()}
    print(f"  decode of {DECODE_TOKENS} tokens after the prefill: "
          + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in decode_s.items()))  # fmt: skip
    dt = str(dtype).removeprefix("torch.")
    return {"L": L, "heads": heads, "head_dim": head_dim, "dtype": dt, "results": results,
            "core_s": core, "decode_s": decode_s}  # fmt: skip


def markdown(record: dict[str, Any], device: torch.device | str = "cpu") -> str:
    import platform

    import transformers as tf

    device = torch.device(device)
    where = f"{platform.processor() or 'a CPU'} ({torch.get_num_threads()} threads)"
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    flag = "" if device.type == "cpu" else f" --device {device.type}"
    r, core, decode = record["results"], record["core_s"], record["decode_s"]
    base = r["Hugging Face layer"]["time_s"]
    lines = [
        f"Measured {datetime.now(timezone.utc):%Y-%m-%d} on {where}, {record['dtype']}, torch "
        f"{torch.__version__}, transformers {tf.__version__}, with "
        f"`python -m cakeops.bench.minimax{flag}`: one `MiniMaxLightningAttention` layer, "
        f"L = {record['L']}, {record['heads']} heads of {record['head_dim']}, median times, "
        "the contenders in alternation. The core's time is the layer's minus the layer's "
        "without its core.",
        "",
        "| forward+backward | time (ms) | vs Hugging Face | peak (MiB) | saved (MiB) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for label, x in r.items():
        mib = f"{x['peak_bytes'] / 2**20:.1f} | {x['saved_bytes'] / 2**20:.1f}"
        lines.append(f"| {label} | {x['time_s'] * 1e3:.1f} | {base / x['time_s']:.2f}x | {mib} |")
    hf_core, our_core = core["Hugging Face"], core["cakeops"]
    lines += [
        f"| the core alone: Hugging Face | {hf_core * 1e3:.1f} | 1.00x | | |",
        f"| the core alone: cakeops | {our_core * 1e3:.1f} | {hf_core / our_core:.2f}x | | |",
        "",
        f"| decode, {DECODE_TOKENS} tokens after the prefill | time (ms) | vs Hugging Face |",
        "| --- | ---: | ---: |",
    ]
    for label, seconds in decode.items():
        lines.append(f"| {label} | {seconds * 1e3:.1f} | "
                     f"{decode['Hugging Face layer'] / seconds:.2f}x |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cakeops.bench.minimax", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a short sequence, two small heads")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--markdown", metavar="PATH", help="write the tables there")
    args = parser.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("cakeops.bench.minimax: transformers is not installed (pip install "
              "cakeops[transformers]); nothing measured")  # fmt: skip
        return NO_TRANSFORMERS
    record = run(args.quick, args.device)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(markdown(record, args.device))
        print(f"wrote {args.markdown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
