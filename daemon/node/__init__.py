"""This node as the job bodies and the service see it.

``node``: ``Node`` (config, CRIU, GPU, the store, state directories, host facts, reaper,
container runtimes; the compatibility gate for a manifest) and ``StoreHandle``;
``storecheck``: the background store check; ``status``: the daemon's read-only status answers.
"""
