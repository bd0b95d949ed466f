"""The compatibility gate: what a checkpoint was taken against, and every reason it cannot
restore on this node.

``stamp``: the stamp a checkpoint carries (host, gpusnap, engine, model, files, launch spec,
process tree); ``container_stamp``: a container checkpoint's ``container`` section and its
rules; ``compat``: the host rules (``POLICY``, ``check_compat``); ``verdict``: ``Reason`` and
``CompatVerdict``, the vocabulary every rule answers in. ``verdict`` imports nothing, so the
GPU layer's own rules (``gpu/compat.py``) answer in it too; ``Node.reasons`` asks all of them.
"""
