"""Jobs: what a checkpoint or restore request becomes, and how it runs.

``job`` holds the value types (``Job``, its kind, state, phase and progress), ``executor``
runs job bodies on threads and streams their changes (``JobContext`` is all a body sees of
its job), ``journal`` keeps every job in SQLite across restarts.

Knows nothing of what a job does: must not import the job bodies
(``daemon/pipelines/``), the host, the GPU layer, the store or the API.
"""
