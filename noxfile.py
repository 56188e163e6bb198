"""Every dev task: ``nox -s tests``, ``lint``, ``demo``, ``bench``, ``docs``, ``gpu_compile``,
``gpu_peers``, ``gpu``, ``gpu_dry_run_image``, ``resolve``.

Each session builds and installs the distributions (wheels, not editable) into its own venv, with
torch pinned by ``.ci/constraints.txt``.
"""

from __future__ import annotations

import os
import sys

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["lint", "tests"]

CONSTRAINTS = ("-c", ".ci/constraints.txt")
PACKAGES = ("./spec", "./packages/torch", "./packages/triton", "./packages/numba[cuda]")
EXAMPLE_BACKEND = "./tests/example_backend"


def install(session: nox.Session, *extra: str) -> None:
    session.install(*CONSTRAINTS, *PACKAGES, *extra)


def gpu_here() -> bool:
    """Whether this machine has a GPU driver (NVIDIA's or AMD's device files)."""
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd"))


#: Fails if the environment has a GPU-only package torch itself does not require (PyPI's CUDA
#: build of torch brings Triton; PyTorch's CPU build brings nothing of the kind).
CPU_ONLY_CHECK = """
import importlib.metadata as md, importlib.util as u
needed = " ".join(md.requires("torch") or [])
extra = [m for m in ("triton", "numba_cuda") if u.find_spec(m) and m not in needed]
assert not extra, f"GPU-only packages installed on a CPU machine: {extra}"
print("nothing GPU-only installed beyond what torch requires")
"""


def install_for_here(session: nox.Session, *extra: str) -> None:
    """:func:`install` where a GPU is; on a CPU machine the CPU backends only: nothing that
    runs on GPUs alone (Triton, numba-cuda and its CUDA bindings: minutes of downloads),
    checked."""
    if gpu_here():
        install(session, *extra)
        return
    session.install(*CONSTRAINTS, "./spec", "./packages/torch", "./packages/numba", *extra)
    session.run("python", "-c", CPU_ONLY_CHECK)


#: what the tests session installs besides the packages
TEST_TOOLS = ("pytest", "pytest-xdist", "pytest-timeout", "hatchling", "twine", "numpy",
              "matplotlib", "transformers", "accelerate")  # fmt: skip


@nox.session(venv_backend="none")
def resolve(session: nox.Session) -> None:
    """The README's two commands' set-ups resolved from the public package index alone (pip's
    configuration, its environment and any local wheel folder ignored), as a stranger's machine
    resolves them: a dry run, which fetches the packages' metadata only (the CUDA build of
    torch that PyPI serves is gigabytes)."""
    pip = (sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed",
           "--quiet", *CONSTRAINTS)  # fmt: skip
    session.run(*pip, *PACKAGES, EXAMPLE_BACKEND, *TEST_TOOLS, env={"PIP_CONFIG_FILE": "/dev/null"})
    session.run(*pip, "./spec", "./packages/torch", "./packages/numba", "numpy", "matplotlib",
                env={"PIP_CONFIG_FILE": "/dev/null"})  # fmt: skip


@nox.session
def tests(session: nox.Session) -> None:
    """The whole suite: conformance on every in-tree backend, dispatch, CLI, packaging."""
    # hatchling and twine: tests/tooling/test_packaging.py builds every sdist and wheel, twine
    # checks them
    install(session, EXAMPLE_BACKEND, *TEST_TOOLS)
    # two processes per core pair at most: each holds torch and transformers (about 1 GB)
    workers = str(min(os.cpu_count() or 1, 4))
    full = "--full" in session.posargs
    # the slowest tests named in the log: where CI's time goes
    slowest = "--durations=15"
    session.run("pytest", "-n", workers, slowest, *(a for a in session.posargs if a != "--full"))
    # Every op through the CPU benchmarks, small (integer inputs, peers, tables).
    session.run("cakeops", "bench", "--quick")
    # (The GPU script's every step runs on the CPU in nox -s gpu_dry_run_image, on the versions
    # a GPU runs it with.)
    # The documented command a third-party backend certifies itself with.
    session.run("pytest", "--pyargs", "cakeops.testing", "--cakeops-backend=example", "-q")
    # The Triton kernels on CPU tensors through Triton's interpreter (no GPU here), one process
    # per core: the interpreter is single-threaded Python. The checks of the op's PyTorch glue
    # (opcheck, compile), the same for every backend and run in full above, with -- --full.
    # The stateful ops' structural checks (packed equals separate, prefill then continuation)
    # in float32 and bfloat16: float16 takes the same kernels with another load and store,
    # whose values the op's other float16 checks cover; all with -- --full.
    structural = "(equal_separate_calls or prefill_then_continuation) and triton-float16"
    glue = [] if full else ["-k", f"not (opcheck or compile or {structural})"]
    session.run(
        "pytest", "--pyargs", "cakeops.testing", "--cakeops-backend=triton", "-q", "-n", "auto",
        *glue, slowest, env={"TRITON_INTERPRET": "1"},
    )  # fmt: skip
    # (The numba backend's CPU kernels ran natively, at full size, in the first run.)
    # The numba-cuda kernels on CPU tensors in numba's CUDA simulator. It runs every simulated
    # thread's every scalar operation in Python (about 10 us each): the two L = 8192 checks of
    # causal_dot_product alone would take over 10 minutes, so they run only on a real GPU
    # (the GPU check, tests/gpu/run.py, runs them on CUDA). The experts' checks of the op's
    # PyTorch glue (opcheck, compile, torch.func, autocast, the default dtype, checkpointing,
    # the saved tensors), which is the same for every backend and runs in full above, take a
    # third of this run there, and their determinism check a few minutes (the simulator runs
    # threads one after another; the GPU check runs it on CUDA); every op's opcheck and compile
    # checks likewise; and the experts' float16 checks (the kernels read a float16 input with
    # the same `widen` every other op's float16 checks run here; the products are float32):
    # with `nox -s tests -- --full` they run here too.
    skipped = "test_long_sequence" + ("" if full else " or opcheck or compile or ("
        "Contract_moe_experts or Contract_routed_experts) and (torch_func or autocast or "
        "default_dtype or checkpoint or saves_exactly or deterministic) or (MoEExperts or "
        "RoutedExperts) and numba-float16")  # fmt: skip
    session.run(
        "pytest", "--pyargs", "cakeops.testing", "--cakeops-backend=numba", "-q", "-n", "auto",
        "-k", f"not ({skipped})", slowest, env={"NUMBA_ENABLE_CUDASIM": "1"},
    )  # fmt: skip


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, then mypy: every in-tree backend's kernel modules against their op's protocol."""
    session.install("ruff", "mypy")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("python", "tests/typecheck/kernels.py")


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: what is installed and chosen here, the quickstart, then a tiny hybrid model
    (three of the six ops) trained on associative recall. ``CAKEOPS_BACKEND`` passes through."""
    install_for_here(session, "numpy", "matplotlib")  # numpy: torch warns without it; the curve
    session.run("cakeops", "info")
    session.run("python", "docs/examples/quickstart.py")
    session.run("python", "docs/examples/demo.py")


@nox.session
def bench(session: nox.Session) -> None:
    """Side-by-side benchmarks: time ratios, peak and saved memory (``-- --quick``: small)."""
    install(session, "numpy", "matplotlib")
    # A full run refreshes the figures, the records (docs/bench/cpu/<op>.json) and the plots the
    # docs show; a --quick run only prints.
    record = ["--markdown", "docs/bench/cpu", "--plots", "docs/content/bench/cpu"]
    record = [] if "--quick" in session.posargs else record
    session.run("cakeops", "bench", "--json", "bench-results/bench.json", *record, *session.posargs)
    # A training step of small Hugging Face MoE models: eager experts, grouped_mm, cakeops.
    session.install(*CONSTRAINTS, "transformers")
    hf = (
        ["--quick"]
        if "--quick" in session.posargs
        else ["--markdown", "docs/bench/cpu/hf_models.md"]
    )
    session.run("python", "-m", "cakeops.bench.hf_models", *hf)
    # MiniMax's lightning-attention layer: Hugging Face's against its core on cakeops.
    mm = ["--quick"] if "--quick" in session.posargs else [
        "--markdown", "docs/bench/cpu/minimax.md"]  # fmt: skip
    session.run("python", "-m", "cakeops.bench.minimax", *mm)
    # Qwen3-Next's Gated DeltaNet layer: Hugging Face's against its delta rule on cakeops.
    qn = ["--quick"] if "--quick" in session.posargs else [
        "--markdown", "docs/bench/cpu/qwen3_next.md"]  # fmt: skip
    session.run("python", "-m", "cakeops.bench.qwen3_next", *qn)
    # Kimi Linear's KDA layer: Hugging Face's against KDA on cakeops.
    kl = ["--quick"] if "--quick" in session.posargs else [
        "--markdown", "docs/bench/cpu/kimi_linear.md"]  # fmt: skip
    session.run("python", "-m", "cakeops.bench.kimi_linear", *kl)
    # Mamba2: the SSD scan, the mixer's training step and a decode, Hugging Face's against
    # cakeops.
    m2 = ["--quick"] if "--quick" in session.posargs else [
        "--markdown", "docs/bench/cpu/mamba2.md"]  # fmt: skip
    session.run("python", "-m", "cakeops.bench.mamba2", *m2)
    # Expert parallelism: 2 processes x 1 thread against 1 process x 2 threads.
    ep = ["--quick"] if "--quick" in session.posargs else [
        "--markdown", "docs/bench/cpu/expert_parallel.md"]  # fmt: skip
    session.run("python", "-m", "cakeops.bench.expert_parallel", *ep)


#: The Triton versions the compile check runs on: the GPU image's (its table is the docs') and
#: the one PyPI's torch 2.13.0 requires (the pins').
COMPILE_TRITONS = ("3.6.0", "3.7.1")


@nox.session
@nox.parametrize("triton", COMPILE_TRITONS, ids=[v.rsplit(".", 1)[0] for v in COMPILE_TRITONS])
def gpu_compile(session: nox.Session, triton: str) -> None:
    """Compile every Triton kernel for sm_90 (H100/H200) and sm_80 (A100), and every numba-cuda
    kernel for sm_90 (sm_80 too with ``-- --full``), without a GPU, at every config the host
    code reaches at the conformance and benchmark shapes, then the Triton kernels over the
    resource sweep; write ``bench-results/gpu-compile.json`` and the
    table in ``docs/content/gpu.md``; fail on compile errors, 16-bit spills, shared memory over
    the limit and 16-bit ``tl.dot`` s on FMA. On the other Triton version, the Triton kernels
    alone (``bench-results/triton-<version>/``), to the same rules."""
    # NVVM and NVRTC for numba-cuda's compile_ptx (and their ptxas); Triton ships its own.
    # pytest: the shapes come from the conformance suite's modules.
    install(session, "pytest", "nvidia-cuda-nvcc-cu12", "nvidia-cuda-nvrtc-cu12")
    session.install("--no-deps", f"triton=={triton}")
    image = f"triton=={triton}" == GPU_IMAGE_TRITON
    out = [] if image else ["--out", f"bench-results/triton-{triton}"]
    first = ["--docs", "docs/content/gpu.md"] if image else ["--triton-only", *out]
    # The calls no GPU run makes (the CPU benchmarks' shapes, the GPU benchmark's in other
    # dtypes) in float32 and bfloat16, and on the other version bfloat16 alone (the sweep below
    # takes float16 there): float16 everywhere with -- --full.
    asked = list(session.posargs)
    session.run("python", "tests/gpu_compile/run_all.py", *first, *asked)
    # The resource sweep: every config the rules keep at shapes no test uses (head sizes 16-256,
    # non-power-of-two D and F), 16-bit and mixed: fails on any spill. One 16-bit dtype per
    # version (their register counts differ by a few at most; each is swept on one compiler),
    # both with -- --full.
    if "--sweep" not in asked:
        sixteen = [] if "--full" in session.posargs else ["--dtype", "bfloat16" if image else
                                                          "float16"]  # fmt: skip
        session.run("python", "tests/gpu_compile/run_all.py", "--sweep", *sixteen, *out)
    # The predicted H200 table (roofline per launch at the benchmark shapes).
    if image:
        session.run("python", "tests/gpu_compile/predict.py", "--docs", "docs/content/gpu.md")


@nox.session
def gpu_peers(session: nox.Session) -> None:
    """The H200 forecast over flash-linear-attention's kernels beside cakeops'
    (``tests/gpu_compile/peers.py``): written into ``docs/content/gpu.md``. fla-core is a test
    oracle here, never a dependency; the pinned Triton 3.7.1 (fla refuses its gated backward on
    Hopper with older versions, the GPU image's 3.6 included)."""
    # pytest: the shapes come from the conformance suite's modules (as in gpu_compile)
    install(session, "pytest", "fla-core", "einops")
    session.run("python", "tests/gpu_compile/peers.py", "--docs", "docs/content/gpu.md",
                "--json", "bench-results/gpu-peers.json")  # fmt: skip


#: The GPU image's versions: its torch (2.11, the CUDA build from PyPI: on a machine without a
#: GPU it runs on the CPU), Triton, numba, numba-cuda and transformers, and the newest NumPy that
#: ``pip install numpy`` gives.
GPU_IMAGE_TRITON = "triton==3.6.0"
DEVICE_IMAGE = ("torch==2.11.0", GPU_IMAGE_TRITON, "numba==0.68.1", "numba-cuda==0.30.4",
                "transformers==5.17.0", "numpy", "pytest", "pytest-xdist", "pytest-timeout",
                "matplotlib")  # fmt: skip


@nox.session
def gpu_dry_run_image(session: nox.Session) -> None:
    """``tests/gpu/run.py --dry-run`` as the GPU machine runs it: the sources uninstalled (the
    script's shims), on the device image's versions (:data:`DEVICE_IMAGE`), not the pins."""
    session.install(*DEVICE_IMAGE)
    session.run("python", "-c", "import numpy, torch, transformers; print('torch', "
                "torch.__version__, 'numpy', numpy.__version__, 'transformers', "
                "transformers.__version__)")  # fmt: skip
    session.run("python", "tests/gpu/run.py", "--dry-run", "--out", f"{session.create_tmp()}/gpu")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site; warnings fail the build."""
    # The backends too: the dtype tables are generated from their registry (docs/hooks.py); a
    # backend registers without its kernels' libraries, so Triton's needs no Triton here.
    install_for_here(session, "mkdocs>=1.6,<2", "mkdocs-material>=9.5,<10")
    if not gpu_here():
        session.install("--no-deps", "./packages/triton")
    session.env["NO_MKDOCS_2_WARNING"] = "1"
    session.run("mkdocs", "build", "--strict", "-f", "docs/mkdocs.yml", "-d", "../site")


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """On a CUDA machine: ``tests/gpu/run.py`` (preflight, benchmarks, conformance, Hugging Face
    models; results under $OUT or bench-results/gpu). The script needs no nox: this is a
    shortcut to it (``-- --dry-run``: the same steps on the CPU)."""
    session.run("python", "tests/gpu/run.py", *session.posargs)
