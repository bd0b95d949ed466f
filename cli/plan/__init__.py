"""``gpusnap plan``: what a serving process holds, and whether its reclaim checkpoint fits.

Reads a model's ``config.json`` the way the serving engines do (vLLM's KV-cache specs,
SGLang's memory pools), sizes the KV cache and recurrent state per token and per session,
the engine's pre-allocated pool, the full and the reclaim checkpoint, and compares the
reclaim checkpoint's upload time with each cloud's notice. ``docs/planning.md`` explains the
figures.

Modules: ``shapes`` (config fields and layer shapes), ``families`` (which layer is which kind),
``engines`` (each engine's accounting), ``estimate`` (the plan), ``bandwidth`` (a timed upload
to a store), ``render`` and ``plot`` (output), ``command`` (the subcommand).

May import ``gpusnap.storage`` (the bandwidth probe) and ``gpusnap.errors``; never
``gpusnap.daemon``. matplotlib is imported only by ``plot``, and only when ``--plot`` is given.
"""

from gpusnap.cli.plan.command import register

__all__ = ["register"]
