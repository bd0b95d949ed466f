"""Test users and groups on this machine (root only): made once, reused by later runs.

useradd/groupadd/usermod write /etc/passwd and /etc/group under a lock that a second one
fails on (exit 10): modules that call these carry ``xdist_group("etc-passwd")``.
"""

from __future__ import annotations

import grp
import pwd
import subprocess


def ensure_group(name: str) -> int:
    """The gid of system group ``name``, made if missing."""
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        rc = subprocess.run(["groupadd", "--system", name], check=False).returncode
        assert rc in (0, 9)  # 9: made meanwhile by another test
        return grp.getgrnam(name).gr_gid


def ensure_user(name: str, groups: list[str]) -> pwd.struct_passwd:
    """System user ``name`` (no home, no shell), made if missing, a member of ``groups``."""
    for g in groups:
        ensure_group(g)
    try:
        pwd.getpwnam(name)
    except KeyError:
        cmd = ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin"]
        rc = subprocess.run([*cmd, name], check=False).returncode
        assert rc in (0, 9)
    member_of = {g.gr_name for g in grp.getgrall() if name in g.gr_mem}
    for g in groups:
        if g not in member_of:
            subprocess.run(["usermod", "-aG", g, name], check=True)
    return pwd.getpwnam(name)
