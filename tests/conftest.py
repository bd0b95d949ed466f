"""Suite-wide pytest configuration: the shared fixtures are one plugin, ``tests/support/
plugin.py`` (the moto server, daemons, workloads, the fake driver); a folder's own fixtures
live in its conftest.py. Test modules import helpers from ordinary modules, never a conftest.
"""

pytest_plugins = ["tests.support.plugin"]
