"""What the benchmarks of a Hugging Face layer against its cakeops-patched copy share
(``cakeops.bench.qwen3_next``, ``cakeops.bench.kimi_linear``, ``cakeops.bench.mamba2``): the
patched copy, a layer's training step and its table, a greedy decode timed in alternation, and
the command line."""

from __future__ import annotations

import argparse
import copy
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cakeops.bench.timing import fwd_bwd
from cakeops.measure import alternating_times

NO_TRANSFORMERS = 2


def on_cakeops(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module`` as ``apply_cakeops`` leaves it (the rest the model's own)."""
    from cakeops.integrations.transformers import apply_cakeops

    holder = torch.nn.ModuleList([copy.deepcopy(module)])
    apply_cakeops(holder)
    return holder[0]


def layer_steps(layers: dict[str, torch.nn.Module], x: torch.Tensor, g: torch.Tensor):
    """label -> (forward, forward+backward into x and every parameter) of each layer on x."""
    return {label: fwd_bwd(lambda x_, *_, layer=layer: layer(x_), (x, *layer.parameters()), g)
            for label, layer in layers.items()}  # fmt: skip


def train_case(hf: torch.nn.Module, L: int, hidden: int, repeats: int, title: str):
    """A training step of the layer ``hf`` and of its cakeops-patched copy on ``(1, L, hidden)``
    inputs, timed in alternation (``repeats`` rounds, Hugging Face's seconds-long steps too);
    prints the table headed ``title``."""
    from cakeops.bench.tables import format_table
    from cakeops.bench.timing import measure

    ours = on_cakeops(hf)
    x = torch.randn(1, L, hidden, requires_grad=True)
    g = torch.randn(1, L, hidden)
    contenders = layer_steps({"Hugging Face layer": hf, "cakeops layer": ours}, x, g)
    results = measure(contenders, torch.device("cpu"), repeats=repeats, slow_s=math.inf)
    print(format_table(title, results, "Hugging Face layer"))
    return results


def run(shapes: dict[str, tuple], train: Callable[..., Any], config: Callable[..., Any],
        quick: bool, prefill: int, tokens: int) -> dict[str, Any]:  # fmt: skip
    """Each shape's training step (``train(*shape, quick)``), then a greedy decode of ``tokens``
    tokens after a ``prefill``-token prompt with a model of the first shape
    (``config(*shape[1:])``, the shape after ``L``), Hugging Face's and patched."""
    import transformers as tf

    layers = {name: {"shape": shape, "results": train(*shape, quick)}
              for name, shape in shapes.items()}  # fmt: skip
    torch.manual_seed(0)
    cfg = config(*next(iter(shapes.values()))[1:])
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    patched = on_cakeops(model)
    prompt = torch.randint(0, 256, (1, prefill), generator=torch.Generator().manual_seed(1))
    decode_s, same = time_decode(model, patched, prompt, tokens, quick)
    return {"layers": layers, "decode_shape": next(iter(shapes)), "decode_s": decode_s,
            "same_tokens": same}  # fmt: skip


def time_decode(model, patched, prompt: torch.Tensor, tokens: int, quick: bool,
                repeats: int | None = None):  # fmt: skip
    """``(median seconds per model, same tokens)`` of a greedy decode of ``tokens`` tokens
    after ``prompt``, the two models in alternation (``repeats`` rounds; by default 3 with
    ``quick``, else 15)."""

    def decode(m):
        def run_():
            with torch.no_grad():
                return m.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens,
                                  do_sample=False)  # fmt: skip

        return run_

    same = torch.equal(decode(model)(), decode(patched)())
    times = alternating_times({"Hugging Face model": decode(model),
                               "cakeops model": decode(patched)}, torch.device("cpu"),
                              repeats=repeats or (3 if quick else 15),
                              warmup=1 if quick else 2)  # fmt: skip
    seconds = {label: statistics.median(t) for label, t in times.items()}
    print(f"  greedy decode of {tokens} tokens after a {prompt.shape[1]}-token prompt (same "
          f"tokens: {same}): " + ", ".join(f"{k} {v * 1e3:.1f} ms"
                                           for k, v in seconds.items()))  # fmt: skip
    return seconds, same


def layer_table(layers: dict[str, dict[str, Any]]) -> list[str]:
    """The markdown lines of the training steps ``{name: {"shape": (L, ...), "results": ...}}``
    against Hugging Face's layer."""
    lines = [
        "| layer, forward+backward | L | time (ms) | vs Hugging Face | peak (MiB) | saved (MiB) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, case in layers.items():
        r = case["results"]
        base = r["Hugging Face layer"]["time_s"]
        for label, x in r.items():
            mib = f"{x['peak_bytes'] / 2**20:.1f} | {x['saved_bytes'] / 2**20:.1f}"
            lines.append(f"| {label}, {name} | {case['shape'][0]} | {x['time_s'] * 1e3:.1f} | "
                         f"{base / x['time_s']:.2f}x | {mib} |")  # fmt: skip
    return lines


def decode_table(what: str, decode: dict[str, float], same: bool) -> list[str]:
    """The markdown lines of :func:`time_decode`'s result: ``what`` heads the table."""
    lines = ["", f"| {what} | time (ms) | vs Hugging Face |", "| --- | ---: | ---: |"]
    for label, seconds in decode.items():
        lines.append(f"| {label} | {seconds * 1e3:.1f} | "
                     f"{decode['Hugging Face model'] / seconds:.2f}x |")  # fmt: skip
    return [*lines, "", f"The two models generated {'the same' if same else 'NOT the same'} "
            "tokens."]  # fmt: skip


def main(prog: str, doc: str, run: Callable[[bool], dict[str, Any]],
         markdown: Callable[[dict[str, Any]], str], argv: list[str] | None) -> int:  # fmt: skip
    """``python -m <prog> [--quick] [--markdown PATH]``: exits 2 without transformers."""
    parser = argparse.ArgumentParser(prog=f"python -m {prog}", description=doc)
    parser.add_argument("--quick", action="store_true", help="a short sequence, small heads")
    parser.add_argument("--markdown", metavar="PATH", help="write the tables there")
    args = parser.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print(f"{prog}: transformers is not installed (pip install cakeops[transformers]); "
              "nothing measured")  # fmt: skip
        return NO_TRANSFORMERS
    record = run(args.quick)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(markdown(record))
        print(f"wrote {args.markdown}")
    return 0
