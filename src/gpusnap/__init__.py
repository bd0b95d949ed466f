"""gpusnap: GPU checkpoint and migration for long-context serving workloads.

The subpackages live in the repository's top-level folders (``storage/``, ``daemon/``,
``proto/``, ``cli/``) and are linked into this namespace so that a wheel and an editable
install both import them as ``gpusnap.<name>``.
"""

__version__ = "0.1.0"
