"""Side-by-side benchmarks: the op on its selected backend against what a user would write.

Each op module here defines ``cases(quick)`` (name -> input factory) and ``contenders(inputs)``
(label -> callable running forward and backward, returning the output). For each case every
contender is measured in the same run: median time of forward+backward, peak memory allocated
during it (CUDA allocator statistics, or the profiler's allocation events on CPU), and the bytes
the autograd graph holds between forward and backward (saved-tensor hooks).

By job: :mod:`~cakeops.bench.timing` measures, :mod:`~cakeops.bench.tables` prints and writes
the Markdown, :mod:`~cakeops.bench.plots` draws, :mod:`~cakeops.bench.runner` runs
``cakeops bench``; :mod:`~cakeops.bench.limits` measures the machine.
"""

from cakeops.bench.limits import Work
from cakeops.bench.plots import write_plots
from cakeops.bench.runner import rerender, run
from cakeops.bench.tables import format_table, op_markdown, write_markdown
from cakeops.bench.timing import cakeops_rows, example_run, measure, result_row, step_of

__all__ = [
    "Work",
    "cakeops_rows",
    "example_run",
    "format_table",
    "measure",
    "op_markdown",
    "rerender",
    "result_row",
    "run",
    "step_of",
    "write_markdown",
    "write_plots",
]
