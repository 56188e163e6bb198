"""``cakeops info`` as a console script and as ``python -m cakeops``."""

import json
import os
import subprocess
import sys

import pytest


def run(*args, env=None):
    full_env = {**os.environ, **(env or {})}
    full_env.pop("CAKEOPS_BACKEND", None) if env is None else None
    return subprocess.run(args, capture_output=True, text=True, env=full_env, check=True).stdout


@pytest.mark.parametrize("cmd", [["cakeops"], [sys.executable, "-m", "cakeops"]])
def test_info_lists_versions_backends_and_picks(cmd):
    out = run(*cmd, "info")
    assert "torch " in out and "cakeops " in out
    assert "devices: cpu" in out
    assert "torch      cakeops-torch" in out
    # numba: CUDA kernels, and on the CPU the ops whose njit kernels beat torch's
    assert "numba      cakeops-numba 0.1.0  available" in out
    assert "causal_dot_product: cuda: priority 5, cpu: priority 20" in out
    assert "triton     cakeops-triton 0.1.0  unavailable: no CUDA or ROCm device" in out
    # the norm's example is a decode step's size: the njit kernel
    assert "rmsnorm_silu_gate    cpu   float16=numba  bfloat16=numba  float32=numba" in out
    assert "causal_dot_product   cpu   float16=numba  bfloat16=numba  float32=numba" in out
    # ... for the small examples only: numba's norm takes decode-sized calls alone
    assert "for each op's small example call; a backend may serve only some sizes" in out
    assert "`cakeops explain OP NAME=SHAPE ...` for yours" in out


def test_info_json_reflects_a_forced_backend():
    info = json.loads(run("cakeops", "info", "--json", env={"CAKEOPS_BACKEND": "reference"}))
    assert info["picks"]["rmsnorm_silu_gate"]["cpu"]["float32"] == "reference"
    assert info["forced"]["rmsnorm_silu_gate"] == "reference (from CAKEOPS_BACKEND)"
    assert info["backends"]["torch"]["ops"]["rmsnorm_silu_gate"]["devices"] == {"*": 10}
    # example declares float32 only, so a forced example leaves float64 with no backend
    info = json.loads(run("cakeops", "info", "--json", env={"CAKEOPS_BACKEND": "example"}))
    assert info["picks"]["rmsnorm_silu_gate"]["cpu"]["float64"] == "none"


def test_bench_renders_tables_and_plots_from_a_saved_record(tmp_path):
    times = {"cakeops [torch]": 0.5, "eager composite": 1.0}
    record = {
        "date": "2026-11-29T00:00:00+00:00",
        "machine": {
            "platform": "Linux", "processor": "x86_64", "torch": "2.13.0", "threads": 2,
            "device": "cpu",
        },
        "command": "cakeops bench",
        # 1 GB/s: the row moving 1e8 bytes in 0.5 s reaches 20% of it
        "limits": {"copy_bytes_per_s": 1e9, "float32_flop_per_s": 1e10, "bf16_flop_per_s": 3e10},
        "results": {
            op: [
                {
                    "case": "rows 8, D 4", "dtype": "float32", "backend": "torch",
                    "baseline": "eager composite", "input_bytes": 64,
                    "work": {"kind": "bytes", "amount": 1e8},
                    "results": {
                        label: {"time_s": t, "peak_bytes": 2**20 * t, "saved_bytes": 64}
                        for label, t in times.items()
                    },
                }
            ]
            for op in ("rmsnorm_silu_gate", "moe_experts")
        },
    }  # fmt: skip
    saved = tmp_path / "bench.json"
    saved.write_text(json.dumps(record))
    out = run(
        "cakeops", "bench", "--from-json", str(saved), "--op", "rmsnorm_silu_gate",
        "--markdown", str(tmp_path / "md"), "--plots", str(tmp_path / "png"),
    )  # fmt: skip
    # one figure per case, at the docs' text width (7.5 in at 110 dpi), one case high
    figures = sorted(p.relative_to(tmp_path / "png") for p in (tmp_path / "png").rglob("*.png"))
    assert [str(p) for p in figures] == ["rmsnorm_silu_gate/rows-8-d-4-float32.png"]
    png = (tmp_path / "png" / figures[0]).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert width == 825 and height < 500, (width, height)
    table = (tmp_path / "md" / "rmsnorm_silu_gate.md").read_text()
    assert "| cakeops [torch] | 500.0 | 2.00x | 0.5 | 0.0 | 20% of copy bandwidth |" in table
    assert "| eager composite | 1000.0 | 1.00x | 1.0 | 0.0 | 10% of copy bandwidth |" in table
    assert "copy bandwidth 1.0 GB/s, float32 matmul 10 GFLOP/s" in table
    assert "wrote" in out and not (tmp_path / "md" / "moe_experts.md").exists()
    # the op's record beside its table: the plots can be drawn again from it alone
    kept = json.loads((tmp_path / "md" / "rmsnorm_silu_gate.json").read_text())
    assert list(kept["results"]) == ["rmsnorm_silu_gate"] and kept["date"] == record["date"]
    run("cakeops", "bench", "--from-json", str(tmp_path / "md" / "rmsnorm_silu_gate.json"),
        "--plots", str(tmp_path / "again"))  # fmt: skip
    assert (tmp_path / "again" / figures[0]).is_file()


def test_info_reports_a_malformed_backend_variable_without_a_traceback():
    out = run("cakeops", "info", env={"CAKEOPS_BACKEND": ","})
    assert "forced for rmsnorm_silu_gate: error: CAKEOPS_BACKEND: expected a backend name" in out


def test_bench_limit_fractions():
    """Bytes against the copy bandwidth; FLOPs against the matmul rate of the inputs' dtype,
    bfloat16 against the faster of its own and float32's."""
    from cakeops.bench.limits import Work, fraction

    limits = {"copy_bytes_per_s": 2e10, "float32_flop_per_s": 1e11, "bf16_flop_per_s": 4e11}
    share, key = fraction(Work("bytes", 1e9), "float32", 0.1, limits)
    assert key == "copy_bytes_per_s" and abs(share - 0.5) < 1e-12
    share, key = fraction(Work("flops", 1e10), "float32", 0.2, limits)
    assert key == "float32_flop_per_s" and abs(share - 0.5) < 1e-12
    share, key = fraction(Work("flops", 1e10), "bfloat16", 0.1, limits)
    assert key == "bf16_flop_per_s" and abs(share - 0.25) < 1e-12
    slow_bf16 = {**limits, "bf16_flop_per_s": 1e10}  # no native bfloat16: float32's rate
    assert abs(fraction(Work("flops", 1e10), "bfloat16", 0.2, slow_bf16)[0] - 0.5) < 1e-12
    assert fraction(None, "float32", 0.1, limits) == (None, None)


def test_bench_limits_are_the_fastest_call_of_each_probe(monkeypatch):
    """Each limit comes from the fastest call of its probe: a slow, interrupted call does not
    lower it."""
    import itertools

    import torch

    from cakeops.bench import limits as machine

    seconds = itertools.cycle([3.0, 1.0, 2.0])  # the fastest of any three calls in a row: 1 s

    def fake_times(steps, device, repeats, warmup):
        steps["fn"]()  # the probe itself runs
        return {"fn": [next(seconds) for _ in range(repeats)]}

    monkeypatch.setattr(machine, "alternating_times", fake_times)
    got = machine.measure_limits(torch.device("cpu"), quick=True)
    assert got["copy_bytes_per_s"] == 2 * 4 * (1 << 22)  # 16 MiB read and written in 1 s
    assert got["float32_flop_per_s"] == got["bf16_flop_per_s"] == 2 * 512**3


def test_peak_memory_on_cpu_prints_no_profiler_noise():
    """The profiler behind the CPU peak-memory figure writes a line to stderr at every start and
    stop from C++; the benchmarks' output must not fill with them."""
    code = (
        "import torch\n"
        "from cakeops.measure import peak_memory\n"
        "peaks = [peak_memory(lambda: torch.ones(1 << 16) + 1, torch.device('cpu')) for _ in "
        "range(3)]\n"
        "assert all(p >= 4 << 16 for p in peaks), peaks\n"
        "import sys; print('still here', file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == "still here"


def test_info_suggests_the_backend_a_misspelled_name_meant():
    out = run("cakeops", "info", env={"CAKEOPS_BACKEND": "tritn"})
    assert "'tritn': no backend of that name is installed; did you mean 'triton'?" in out


def test_bench_plots_without_matplotlib_stop_before_measuring(monkeypatch, capsys):
    import importlib.util

    import cakeops.bench
    from cakeops import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name)
    )

    def measured(*args, **kwargs):
        raise AssertionError("measured before checking --plots")

    monkeypatch.setattr(cakeops.bench, "run", measured)
    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", "--plots", "unused"])
    assert stop.value.code == 2
    assert "--plots needs matplotlib" in capsys.readouterr().err


def test_help_texts_are_plain_and_complete():
    assert "``" not in run("cakeops", "--help")
    options = run("cakeops", "bench", "--help").split("options:", 1)[1].splitlines()
    for option in ("--op", "--device", "--quick", "--json", "--markdown", "--plots", "--from-json"):
        at = next(i for i, line in enumerate(options) if line.strip().startswith(option))
        line = options[at].strip()
        same_line = line.split("  ", 1)[1].strip() if "  " in line else ""
        next_line = options[at + 1].strip() if at + 1 < len(options) else ""
        assert same_line or (next_line and not next_line.startswith("-")), f"{option}: no help"


def test_bench_tables_show_page_faults_where_counted(tmp_path):
    """A record whose CPU rows counted page faults gets a *page faults* column (``-`` for a
    contender timed once); one without them keeps the table it always had."""
    from cakeops.bench import op_markdown

    results = {
        "cakeops [torch]": {"time_s": 0.5, "peak_bytes": 0, "saved_bytes": 0, "faults": 1024},
        "eager composite": {"time_s": 1.0, "peak_bytes": 0, "saved_bytes": 0},
    }
    record = {
        "date": "2026-11-30T00:00:00+00:00",
        "machine": {"platform": "Linux", "processor": "x86_64", "torch": "2.13.0", "threads": 2,
                    "device": "cpu"},
        "command": "cakeops bench",
        "results": {"rmsnorm_silu_gate": [{"case": "rows 8, D 4", "dtype": "float32",
                                           "backend": "torch", "baseline": "eager composite",
                                           "results": results}]},
    }  # fmt: skip
    table = op_markdown(record, "rmsnorm_silu_gate")
    assert "| implementation | time (ms) | speed-up | peak (MiB) | saved (MiB) | page faults |" in (
        table
    )
    assert "| cakeops [torch] | 500.0 | 2.00x | 0.0 | 0.0 | 1024 |" in table
    assert "| eager composite | 1000.0 | 1.00x | 0.0 | 0.0 | - |" in table
    del results["cakeops [torch]"]["faults"]
    assert "page faults" not in op_markdown(record, "rmsnorm_silu_gate")


def test_timed_steps_count_the_page_faults_of_fresh_memory():
    """The benchmark's fault count sees a step that touches fresh memory (pages mapped straight
    from the OS, whatever allocator the process runs) and not one that touches none."""
    import mmap

    import torch

    from cakeops.measure import alternating_times, fault_counter

    if sys.platform == "win32":  # no getrusage: the tables then have no faults column
        assert fault_counter() is None
        return

    def fresh():
        with mmap.mmap(-1, 1 << 24) as pages:  # 16 MiB, anonymous: new pages every time
            for offset in range(0, 1 << 24, mmap.PAGESIZE):
                pages[offset] = 1

    faults: dict[str, list[int]] = {}
    alternating_times({"fresh": fresh, "none": lambda: None}, torch.device("cpu"), 3, 0, faults)
    assert min(faults["fresh"]) > max(faults["none"])


def test_timed_steps_run_what_comes_before_each_untimed():
    """``before`` runs before every timed call of every step (not the warm-up's), and its time
    is not the step's."""
    import time

    import torch

    from cakeops.measure import alternating_times

    events: list[str] = []

    def before():
        events.append("before")
        time.sleep(0.02)

    steps = {"a": lambda: events.append("a"), "b": lambda: events.append("b")}
    times = alternating_times(steps, torch.device("cpu"), 3, 1, before=before)
    assert events[:2] == ["a", "b"]  # the warm-up
    rounds = [events[i : i + 4] for i in range(2, len(events), 4)]
    assert len(rounds) == 3 and all(r[::2] == ["before"] * 2 and {*r[1::2]} == {"a", "b"}
                                    for r in rounds)  # fmt: skip
    assert max(max(t) for t in times.values()) < 0.02


def test_timed_steps_take_turns_in_changing_orders():
    """Every round times each step once, in a new order: no step always runs first or after
    the same one (what a step leaves in the caches slows the next)."""
    import torch

    from cakeops.measure import alternating_times

    events: list[str] = []
    steps = {name: lambda name=name: events.append(name) for name in "abc"}
    alternating_times(steps, torch.device("cpu"), 12, 0)
    rounds = [events[i : i + 3] for i in range(0, len(events), 3)]
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds)
    assert {r[0] for r in rounds} == {"a", "b", "c"}
    assert len({tuple(r) for r in rounds}) > 3


def test_help_answers_without_importing_torch():
    """``cakeops --help``, ``cakeops bench --help`` and an argument error answer before torch
    is imported (it took 1.5-9 s before); ``--op``'s names are the specs'."""
    script = (
        "import sys\n"
        "from cakeops.cli import main\n"
        "calls = (['--help'], ['bench', '--help'], ['info', '--help'], ['bench', '--op', 'x'])\n"
        "for argv in calls:\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as exc:\n"
        "        print('exit', exc.code)\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    assert out.count("exit 0") == 3 and "exit 2" in out
    assert "torch imported: False" in out
    assert "usage: cakeops bench" in out
    from cakeops.cli import OP_NAMES
    from cakeops.ops import SPECS

    assert sorted(OP_NAMES) == sorted(SPECS)
    assert run("cakeops", "--help").startswith("usage: cakeops")


def test_import_cakeops_loads_the_ops_on_first_use():
    """Without torch imported, ``import cakeops`` imports nothing heavy; the first public name
    used loads every op (their custom ops registered)."""
    script = (
        "import sys\n"
        "import cakeops\n"
        "assert 'torch' not in sys.modules\n"
        "import torch\n"
        "x = torch.randn(2, 8)\n"
        "y = cakeops.rmsnorm_silu_gate(x, x, torch.ones(8))\n"
        "assert hasattr(torch.ops.cakeops, 'routed_experts_defaults')\n"
        "assert set(cakeops.__all__) == set(cakeops._PUBLIC) <= set(dir(cakeops))\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_every_plot_gives_a_contender_the_same_colour(tmp_path, monkeypatch):
    """Two ops whose rows come in different orders and mixes: each label keeps one colour in
    both plots (colours were handed out per plot before), and no two labels share one."""
    from cakeops.bench import plots

    def row(labels):
        results = {name: {"time_s": 1.0 + i, "peak_bytes": 2**20, "saved_bytes": 0}
                   for i, name in enumerate(labels)}  # fmt: skip
        return {"case": "c", "dtype": "float32", "backend": "torch", "baseline": labels[0],
                "results": results}  # fmt: skip

    record = {
        "date": "2026-12-02T00:00:00+00:00", "command": "cakeops bench",
        "machine": {"platform": "Linux", "processor": "x86_64", "torch": "2.13.0",
                    "threads": 2, "device": "cpu"},
        "results": {
            "rmsnorm_silu_gate": [row(["eager composite", "cakeops [torch]", "torch.compile"])],
            "causal_dot_product": [row(["cakeops [numba]", "torch.compile", "cakeops [torch]",
                                        "eager composite", "fast-transformers"])],
        },
    }  # fmt: skip
    seen: dict[str, set] = {}
    bars = plots._bars

    def spy(ax, labels, values, text, colors, title, **kw):
        for label, colour in zip(labels, colors, strict=True):
            seen.setdefault(label, set()).add(colour)
        return bars(ax, labels, values, text, colors, title, **kw)

    monkeypatch.setattr(plots, "_bars", spy)
    assert len(plots.write_plots(record, tmp_path)) == 2
    assert all(len(c) == 1 for c in seen.values()), seen
    assert len({next(iter(c)) for c in seen.values()}) == len(seen) == 5
    assert seen["cakeops [torch]"] == {plots.BACKEND_COLOURS["cakeops [torch]"]}
    # the same over records saved apart (one per op, as the docs keep them), drawn together
    from cakeops.bench import rerender

    seen.clear()
    paths = []
    for op, rows in record["results"].items():
        paths.append(tmp_path / f"{op}.json")
        paths[-1].write_text(json.dumps({**record, "results": {op: rows}}))
    assert rerender([str(p) for p in paths], None, plots_dir=str(tmp_path / "apart")) == 0
    assert all(len(c) == 1 for c in seen.values()), seen
    assert len({next(iter(c)) for c in seen.values()}) == len(seen) == 5


@pytest.mark.parametrize(
    "args, message",
    [
        (["--device", "bogus"], "argument --device: expected a device such as cpu, cuda or cuda:1, "
                                "got 'bogus'"),
        (["--device", "cuda:x"], "got 'cuda:x'"),
        (["--device", "meta"], "argument --device: no meta device here (got 'meta')"),
        (["--from-json", "{missing}"], "argument --from-json: cannot read a record from {missing}"),
        (["--from-json", "{garbage}"], "argument --from-json: cannot read a record from {garbage}"),
        (["--from-json", "{other}"], "argument --from-json: expected a record 'cakeops bench "
                                     "--json' wrote (an object with 'results'), got {other}"),
        (["--markdown", "{file}/tables"], "cannot write to {file}/tables"),
        (["--json", "{file}/x.json"], "cannot write to {file}"),
    ],
)  # fmt: skip
def test_bench_arguments_it_cannot_use_stop_before_measuring(tmp_path, monkeypatch, capsys,
                                                             args, message):  # fmt: skip
    """A device this machine lacks, a record that cannot be read, an output folder that cannot
    be written: a usage error naming the argument, before anything is measured (a traceback
    came instead, for the folders after the whole run)."""
    import cakeops.bench
    from cakeops import cli

    paths = {"missing": tmp_path / "none.json", "garbage": tmp_path / "garbage.json",
             "other": tmp_path / "other.json", "file": tmp_path / "a-file"}  # fmt: skip
    paths["garbage"].write_text("not json")
    paths["other"].write_text('{"rows": []}')
    paths["file"].write_text("")

    def measured(*a, **k):
        raise AssertionError("measured or rendered before checking the arguments")

    monkeypatch.setattr(cakeops.bench, "run", measured)
    monkeypatch.setattr(cakeops.bench, "rerender", measured)
    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", "--op", "rmsnorm_silu_gate", *(a.format(**paths) for a in args)])
    assert stop.value.code == 2
    assert message.format(**paths) in capsys.readouterr().err


def test_explain_names_the_pick_for_the_sizes_given():
    """``cakeops explain OP [NAME=SHAPE ...]``: the op's example call, its arguments replaced
    by the shapes given, and why each backend was or was not chosen (numba's CPU norm takes
    only decode-sized calls, which ``info``'s small examples do not show)."""
    out = run("cakeops", "explain", "rmsnorm_silu_gate")
    assert "rmsnorm_silu_gate(x=(4, 64)" in out and "on cpu, float32" in out
    assert "rmsnorm_silu_gate: numba (chosen by priority)" in out
    out = run("cakeops", "explain", "rmsnorm_silu_gate", "x=64,1024", "z=64,1024", "weight=1024",
              "eps=1e-5", "--dtype", "bfloat16")  # fmt: skip
    assert "rmsnorm_silu_gate(x=(64, 1024), z=(64, 1024), weight=(1024,), eps=1e-05" in out
    assert "rmsnorm_silu_gate: torch (chosen by priority)" in out
    assert "numba: its CPU kernel is chosen implicitly for up to 16384 elements" in out
    assert "on cpu, bfloat16" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["x=3"], "rmsnorm_silu_gate: argument 'z' expected shape (3,) (the shape of x)"),
        (["--dtype", "int8"], "argument --dtype: expected one of float16, bfloat16, float32"),
        (["nope=3"], "expected NAME=SHAPE or NAME=VALUE with NAME one of x, z, weight"),
        (["x=a,b"], "x: cannot read 'a,b'"),
        (["--device", "cuda:7"], "--device"),
    ],
)
def test_explain_refuses_what_it_cannot_read_with_a_usage_error(args, message):
    done = subprocess.run(["cakeops", "explain", "rmsnorm_silu_gate", *args],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert message in done.stderr, done.stderr


def test_info_into_a_closed_pipe_ends_without_a_traceback():
    """``cakeops info | true``: the reader is gone before the first line (a pipe whose read end
    is closed: every write fails); no BrokenPipeError traceback, a failing exit code."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(["cakeops", "info"], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=300)  # fmt: skip
    finally:
        os.close(write)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
