"""Run the gpusnap CLI as another user: ``python _as_user.py USER ARGS...`` (as root).

Like ``runuser -u USER -- gpusnap ARGS``, but the interpreter is started as root and the
CLI is imported before the switch, so the test works where the interpreter itself lives
somewhere the user cannot read (a pyenv under /root). Groups come from /etc/group
(initgroups), exactly as a login would get them; then the CLI runs unchanged.
"""

from __future__ import annotations

import locale  # noqa: F401 - argparse's gettext imports it lazily
import os
import pwd
import socket  # noqa: F401
import sys

from gpusnap.cli import _client, daemon_cmds  # noqa: F401 - loaded before the switch
from gpusnap.cli.main import build_parser, main

if __name__ == "__main__":
    build_parser()  # every lazy import argparse and the command modules need, while root
    user = pwd.getpwnam(sys.argv[1])
    os.initgroups(user.pw_name, user.pw_gid)
    os.setgid(user.pw_gid)
    os.setuid(user.pw_uid)
    assert os.geteuid() == user.pw_uid
    sys.exit(main(sys.argv[2:]))
