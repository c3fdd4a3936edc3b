"""What a training run shows: TensorBoard events, progress, summary tables, figures.

One module per job:

- ``events``: :class:`RunLogger` writes one run's TensorBoard events (tensorboardX's
  public API), the ``<logdir>/<experiment>/<run>`` layout, :func:`read_scalars`;
- ``progress``: :class:`Progress`, a bar on a terminal, a line every few seconds elsewhere;
- ``tables``: :func:`format_summary` and :func:`format_value`, the plain-text tables;
- ``plots``: the memory timeline of one step and the figure comparing policies.

These modules take plain numbers and data, never tensors: they import nothing from
``framework``, and tensorboardX, tensorboard, matplotlib and tqdm are imported when
first used, so a disabled logger (ranks other than 0) costs nothing.
"""

from .events import RunLogger, default_run_name, event_files, read_scalars, run_dir, timeline_png
from .plots import pareto_front, plot_comparison, plot_timeline, timeline_positions
from .progress import Progress
from .tables import MB, format_summary, format_value

__all__ = [
    "MB",
    "Progress",
    "RunLogger",
    "default_run_name",
    "event_files",
    "format_summary",
    "format_value",
    "pareto_front",
    "plot_comparison",
    "plot_timeline",
    "read_scalars",
    "run_dir",
    "timeline_png",
    "timeline_positions",
]
