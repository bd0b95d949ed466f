"""The host side of a checkpoint: processes as /proc shows them, CRIU, and what runs them again.

``proctree`` reads a process tree (identity, launch spec, packages) from /proc, ``target``
picks the tree a checkpoint takes and refuses what none can capture, ``files`` lists the
files a tree has open or mapped, ``criu`` dumps and restores a tree, ``pagestream`` uploads
CRIU's page images while CRIU writes them, ``coldstart`` runs a launch spec fresh, and
``reaper`` reaps what the daemon restored or started.

The daemon's floor: imports nothing else of the daemon (what it needs of the config, a
workload's ``WorkloadFacts`` and ``StartSpec``, is defined here); ``pagestream`` alone talks
to the store (``CheckpointStore.upload_growing``).
"""
