"""gpusnapd's configuration: one TOML file, parsed and checked completely before anything starts.

``file``: ``load_config``/``parse_config`` and every section's typed, frozen table (``Config``);
``table``: ``Table``, the checked reader each section parses through; ``hooks``: a workload's
``hooks`` table; ``containers``: ``[containers]``. Reclaim's tables are parsed by
``gpusnap.daemon.reclaim.config``, a workload's start spec is ``host/coldstart.py:StartSpec``.
"""
