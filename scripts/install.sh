#!/usr/bin/env bash
# Installs gpusnap as a system service (docs/operations.md, "Install"). Run as root.
#
#   scripts/install.sh [--wheel FILE] [--wheelhouse DIR] [--criu-debs DIR | --no-criu]
#                      [--no-restart] [--root DIR]
#   scripts/install.sh --uninstall [--purge] [--root DIR]
#
# What it puts where (every path under DIR with --root):
#   /opt/gpusnap/venv                       a virtualenv of /usr/bin/python3 holding the gpusnap
#                                           wheel and its runtime dependencies (no dev tools)
#   /usr/bin/gpusnap, /usr/bin/gpusnapd     links into the venv; the directory is the one the
#                                           unit's ExecStart= names, so the two always agree
#   /usr/lib/systemd/system/gpusnapd.service, /usr/lib/sysusers.d/gpusnap.conf,
#   /usr/lib/tmpfiles.d/gpusnap.conf, /usr/lib/systemd/logind.conf.d/60-gpusnapd.conf
#   /usr/share/doc/gpusnap/                 docs/*.md, README.md, gpusnapd.example.toml
#   /etc/gpusnap/gpusnapd.toml              the example config, only when there is none
#   CRIU >= 4                               scripts/install-criu.sh (from its .debs with
#                                           --criu-debs DIR, skipped with --no-criu or --root)
# then applies them: systemd-sysusers (the group gpusnap), systemd-tmpfiles --create, and where
# systemd runs, daemon-reload, logind's config reload, and a restart of gpusnapd when it was
# running and something changed (--no-restart: leave it running the old code until you
# restart it). With --root nothing is applied: a package's postinst, or the target's next
# boot (systemd-sysusers.service, systemd-tmpfiles-setup.service), does it.
#
# The wheel is built from this checkout unless --wheel names one. Its dependencies come from
# the package index, or with --wheelhouse only from DIR (pip --no-index: no network), e.g. one
# made elsewhere with `pip wheel -w DIR gpusnap-*.whl`.
#
# Idempotent: a second run with the same wheel and files changes nothing and restarts nothing.
# An upgrade replaces the venv (built beside it, then swapped in) and the files above; it never
# touches /etc/gpusnap (config, keys) or /var/lib/gpusnap (state, a file:// store).
# --uninstall stops and disables the service and removes what the install put there, keeping
# /etc/gpusnap, /var/lib/gpusnap, the group gpusnap and CRIU; --purge also deletes
# /etc/gpusnap and /var/lib/gpusnap. Restored workloads run in their own scopes and are never
# stopped by either.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)

PYTHON=${GPUSNAP_PYTHON:-/usr/bin/python3}
PREFIX=/opt/gpusnap
VENV=$PREFIX/venv
UNITDIR=/usr/lib/systemd/system
SYSUSERSDIR=/usr/lib/sysusers.d
TMPFILESDIR=/usr/lib/tmpfiles.d
LOGINDDIR=/usr/lib/systemd/logind.conf.d
DOCDIR=/usr/share/doc/gpusnap
CONFDIR=/etc/gpusnap
STATEDIR=/var/lib/gpusnap
MANIFEST=$PREFIX/installed-files
UNIT=gpusnapd.service

log() { echo "install: $*" >&2; }
die() {
  log "error: $*"
  exit 1
}
usage() { # $1: the exit status (0 for --help, 2 for a wrong option)
  sed -n '4,6p' "$0" | sed 's/^#  //' >&2
  exit "$1"
}

root=
wheel=
wheelhouse=
criu=install
criu_debs=
action=install
purge=0
restart=1
while [ $# -gt 0 ]; do
  case "$1" in
    --root | --wheel | --wheelhouse | --criu-debs)
      [ $# -ge 2 ] && [ -n "$2" ] || die "$1 needs a value"
      case "$1" in
        --root) root=$(realpath -m "$2") ;;
        --wheel) wheel=$(realpath "$2") ;;
        --wheelhouse) wheelhouse=$(realpath "$2") ;;
        --criu-debs)
          criu=debs
          criu_debs=$(realpath "$2")
          ;;
      esac
      shift 2
      ;;
    --no-criu) criu=skip && shift ;;
    --no-restart) restart=0 && shift ;;
    --uninstall) action=uninstall && shift ;;
    --purge) purge=1 && shift ;;
    -h | --help) usage 0 ;;
    *) log "error: unknown option $1" && usage 2 ;;
  esac
done
[ "$purge" = 0 ] || [ "$action" = uninstall ] || die "--purge goes with --uninstall"
[ -n "$root" ] || [ "$(id -u)" -eq 0 ] || die "must run as root (or stage into a tree with --root DIR)"
[ "$root" != / ] || root=

# The unit names the binary; the links go where it looks.
exec_start=$(sed -n 's/^ExecStart=\([^ ]*\).*/\1/p' "$here/systemd/$UNIT" | head -n1)
case "$exec_start" in
  /*/gpusnapd) BINDIR=${exec_start%/gpusnapd} ;;
  *) die "systemd/$UNIT: ExecStart= must name an absolute .../gpusnapd, not '$exec_start'" ;;
esac

# Apply system-wide changes only on the live system, and talk to systemd only where it runs.
live=0
[ -n "$root" ] || live=1
systemd_up=0
[ "$live" = 0 ] || [ ! -d /run/systemd/system ] || systemd_up=1

changed=0 # anything the running daemon would see: the venv, the unit
units_changed=0
logind_changed=0
manifest_tmp=

# Installs $1 as $2 (a path on the target) with mode $3, and records it for --uninstall.
# Returns 0 when it changed the target.
put() {
  local src=$1 dst=$root$2 mode=$3
  echo "$2" >>"$manifest_tmp"
  if [ -f "$dst" ] && cmp -s "$src" "$dst" && [ "$(stat -c %a "$dst")" = "${mode#0}" ]; then
    return 1
  fi
  install -D -m "$mode" "$src" "$dst"
  return 0
}

# A hash of the wheel's RECORD (every file's sha256): the same code gives the same stamp,
# however often the wheel is rebuilt.
wheel_stamp() {
  "$PYTHON" - "$1" <<'PY'
import hashlib, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
    print(hashlib.sha256(z.read(record)).hexdigest(), record.split("/")[0])
PY
}

# Builds the venv at $root$VENV.new from $wheel, then swaps it in for $root$VENV.
install_venv() {
  local stage=$root$VENV.new final=$root$VENV stamp
  stamp="$(wheel_stamp "$wheel") $("$PYTHON" -c 'import sys; print(sys.version.split()[0])')"
  if [ -f "$final/.gpusnap-stamp" ] && [ "$(cat "$final/.gpusnap-stamp")" = "$stamp" ] \
    && "$final/bin/python" -I -c 'import gpusnap.daemon.main, gpusnap.cli.main' 2>/dev/null; then
    log "venv $VENV is up to date ($(basename "$wheel"))"
    return
  fi
  log "building the venv for $(basename "$wheel") at $VENV"
  rm -rf "$stage"
  mkdir -p "$(dirname "$stage")"
  "$PYTHON" -m venv "$stage"
  # -I: none of the caller's PYTHONPATH, PYTHONHOME or user site (a gpusnap visible there
  # would count as installed already).
  local pip=("$stage/bin/python" -I -m pip --disable-pip-version-check --no-input -q)
  local src=() # the package index pip is configured with
  [ -z "$wheelhouse" ] || src=(--no-index --find-links "$wheelhouse")
  # --no-compile: the bytecode is written below, once the paths are the final ones.
  "${pip[@]}" install --no-compile --no-cache-dir "${src[@]}" "$wheel" \
    || die "pip could not install $(basename "$wheel")${wheelhouse:+ from $wheelhouse}"
  # The venv was made at $stage; everything that names it must name $VENV (the shebangs of
  # the entry points, the activate scripts, pyvenv.cfg).
  grep -rlI --null -F "$stage" "$stage/bin" "$stage/pyvenv.cfg" | xargs -0 -r sed -i "s|$stage|$VENV|g"
  "$stage/bin/python" -I -m compileall -q -j0 -s "$stage" -p "$VENV" "$stage/lib" >/dev/null \
    || die "compiling the venv's bytecode failed"
  echo "$stamp" >"$stage/.gpusnap-stamp"
  rm -rf "$final.old"
  [ ! -e "$final" ] || mv "$final" "$final.old"
  mv "$stage" "$final"
  rm -rf "$final.old"
  changed=1
}

# Refuses, before anything is changed, to replace a $BINDIR/NAME that is not our link.
check_bin() {
  local dst=$root$BINDIR/$1
  if [ -e "$dst" ] || [ -L "$dst" ]; then
    case "$(readlink "$dst" 2>/dev/null)" in
      "$PREFIX"/*) ;;
      *) die "$BINDIR/$1 exists and is not gpusnap's link into $VENV; remove it first" ;;
    esac
  fi
}

# Links $BINDIR/NAME to the venv's entry point.
link_bin() {
  local name=$1 dst=$root$BINDIR/$1 target=$VENV/bin/$1
  echo "$BINDIR/$name" >>"$manifest_tmp"
  if [ -L "$dst" ] && [ "$(readlink "$dst")" = "$target" ]; then
    return
  fi
  mkdir -p "$root$BINDIR"
  ln -sfn "$target" "$dst"
}

do_install() {
  [ -x "$PYTHON" ] || die "$PYTHON not found (apt-get install python3 python3-venv)"
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || die "$PYTHON is $("$PYTHON" -V 2>&1); gpusnap needs Python >= 3.11"
  "$PYTHON" -c 'import ensurepip, venv' 2>/dev/null \
    || die "$PYTHON cannot make a virtualenv (apt-get install python3-venv)"
  [ -z "$wheelhouse" ] || [ -d "$wheelhouse" ] || die "no wheelhouse folder $wheelhouse"
  check_bin gpusnap
  check_bin gpusnapd

  work=$(mktemp -d /tmp/gpusnap-install.XXXXXX)
  trap 'rm -rf "$work"' EXIT
  manifest_tmp=$work/installed-files
  : >"$manifest_tmp"

  if [ "$criu" != skip ] && [ "$live" = 1 ]; then
    if [ "$criu" = debs ]; then
      bash "$here/scripts/install-criu.sh" --from-debs "$criu_debs"
    else
      bash "$here/scripts/install-criu.sh"
    fi
  elif [ "$live" = 0 ]; then
    log "--root: CRIU is not staged (install it on the target with scripts/install-criu.sh)"
  fi

  if [ -z "$wheel" ]; then
    log "building the gpusnap wheel from $here"
    local builder=$here/.venv/bin/python
    if [ ! -x "$builder" ]; then
      "$PYTHON" -m venv "$work/build-venv"
      builder=$work/build-venv/bin/python
    fi
    "$builder" -m pip --disable-pip-version-check -q wheel --no-deps -w "$work/wheel" "$here" \
      || die "building the wheel failed"
    wheel=$(ls "$work"/wheel/gpusnap-*.whl)
  fi
  [ -f "$wheel" ] || die "no wheel at $wheel"
  install_venv
  link_bin gpusnap
  link_bin gpusnapd

  if put "$here/systemd/$UNIT" "$UNITDIR/$UNIT" 0644; then units_changed=1; fi
  put "$here/systemd/gpusnap.sysusers.conf" "$SYSUSERSDIR/gpusnap.conf" 0644 || true
  put "$here/systemd/gpusnap.tmpfiles.conf" "$TMPFILESDIR/gpusnap.conf" 0644 || true
  if put "$here/systemd/gpusnapd-logind.conf" "$LOGINDDIR/60-gpusnapd.conf" 0644; then
    logind_changed=1
  fi
  local doc
  for doc in "$here"/docs/*.md "$here/README.md"; do
    put "$doc" "$DOCDIR/$(basename "$doc")" 0644 || true
  done
  put "$here/systemd/gpusnapd.example.toml" "$DOCDIR/gpusnapd.example.toml" 0644 || true
  if [ ! -e "$root$CONFDIR/gpusnapd.toml" ]; then
    install -D -m 0640 "$here/systemd/gpusnapd.example.toml" "$root$CONFDIR/gpusnapd.toml"
    log "wrote the example config to $CONFDIR/gpusnapd.toml: edit it (docs/operations.md)"
  else
    log "kept $CONFDIR/gpusnapd.toml (the current example: $DOCDIR/gpusnapd.example.toml)"
  fi

  # Files an older version installed and this one does not: gone with the upgrade.
  local old=$root$MANIFEST stale
  if [ -f "$old" ]; then
    while IFS= read -r stale; do
      [ -n "$stale" ] || continue
      if ! grep -qxF "$stale" "$manifest_tmp"; then
        rm -f "$root$stale"
        log "removed $stale (no longer part of gpusnap)"
      fi
    done <"$old"
  fi
  sort -u "$manifest_tmp" >"$work/manifest"
  cmp -s "$work/manifest" "$root$MANIFEST" || install -D -m 0644 "$work/manifest" "$root$MANIFEST"
  [ "$units_changed" = 0 ] || changed=1

  if [ "$live" = 1 ]; then
    command -v systemd-sysusers >/dev/null || die "systemd-sysusers not found (apt-get install systemd)"
    systemd-sysusers "$SYSUSERSDIR/gpusnap.conf"
    systemd-tmpfiles --create "$TMPFILESDIR/gpusnap.conf"
  fi
  if [ "$systemd_up" = 1 ]; then
    [ "$units_changed" = 0 ] || systemctl daemon-reload
    if [ "$logind_changed" = 1 ] && systemctl -q is-active systemd-logind.service; then
      systemctl kill -s HUP systemd-logind.service # logind rereads logind.conf.d on SIGHUP
    fi
    if systemctl -q is-active "$UNIT"; then
      if [ "$changed" = 0 ]; then
        log "$UNIT keeps running (nothing it uses changed)"
      elif [ "$restart" = 1 ]; then
        log "restarting $UNIT onto the new version"
        systemctl try-restart "$UNIT"
      else
        log "$UNIT still runs the old version: systemctl restart $UNIT when convenient"
      fi
    fi
  elif [ "$live" = 1 ]; then
    log "systemd is not running here: nothing reloaded; start gpusnapd by hand or boot with systemd"
  fi
  log "installed gpusnap $("$root$VENV/bin/python" -I -c 'import gpusnap; print(gpusnap.__version__)') into $VENV ($(du -sh "$root$VENV" | cut -f1)); $BINDIR/gpusnap, $BINDIR/gpusnapd"
  if [ ! -e "$root$CONFDIR/signing.key" ] && grep -q '^key_file *= *"/etc/gpusnap/signing.key"' "$root$CONFDIR/gpusnapd.toml"; then
    log "next: gpusnap store keygen --out $CONFDIR/signing.key, then systemctl enable --now $UNIT"
  fi
}

do_uninstall() {
  if [ "$systemd_up" = 1 ] && systemctl cat "$UNIT" >/dev/null 2>&1; then
    log "stopping and disabling $UNIT (it finishes its running jobs first)"
    systemctl disable --now "$UNIT" || log "warning: could not stop $UNIT"
  fi
  local f
  if [ -f "$root$MANIFEST" ]; then
    while IFS= read -r f; do
      [ -n "$f" ] || continue
      if [ "${f#"$BINDIR"/}" != "$f" ] && [ -e "$root$f" ] && [ ! -L "$root$f" ]; then
        log "warning: kept $f: not a link (not ours)"
        continue
      fi
      rm -f "$root$f"
    done <"$root$MANIFEST"
    rm -f "$root$MANIFEST"
  fi
  rm -rf "$root$VENV" "$root$VENV.new" "$root$VENV.old"
  rmdir "$root$DOCDIR" "$root$PREFIX" 2>/dev/null || true # /opt/gpusnap stays while CRIU is in it
  if [ "$purge" = 1 ]; then
    rm -rf "$root$CONFDIR" "$root$STATEDIR" "$root/run/gpusnap"
    log "purged $CONFDIR (config, keys) and $STATEDIR (state, any file:// store there)"
  else
    log "kept $CONFDIR (config, keys) and $STATEDIR (state); --purge deletes them"
  fi
  [ "$systemd_up" = 0 ] || systemctl daemon-reload
  log "uninstalled; CRIU and the group gpusnap stay (docs/operations.md, Uninstall)"
}

if [ "$action" = install ]; then
  do_install
else
  do_uninstall
fi
