#!/usr/bin/env bash
# Installs CRIU >= 4.2 for gpusnap on Debian 12 or 13 (run as root; scripts/bootstrap.sh calls it).
#
# Why 4.2: CRIU 4.1.1 (Debian 13's) fails on every TCP socket on Linux >= 6.16 ("sockets: Can't
# get 1:16 opt: Operation not supported", criu#2705, fixed in 4.2), so it cannot dump a network
# server on current kernels. Debian unstable ships 4.2.1.
#
# Debian 12 and 13: Debian unstable's criu, libcompel1, libnet9 and libnl-3-200 (criu 4.2.1 wants
# libnl >= 3.11; trixie has 3.7) and Debian 13's libraries for the rest of criu's dependencies are
# downloaded, unpacked (dpkg -x, nothing is installed) into $PREFIX, and run through the
# prefix's own dynamic loader by a wrapper at $WRAPPER. The sid suite (and on Debian 12 the
# trixie suite) is added to apt (unless such a source is configured already: that one is used)
# with a pin of priority 1, so apt never installs or upgrades anything from it by itself; we only
# ever ask for explicit `pkg/sid` and `pkg/trixie` downloads.
# Other Debian (testing, unstable) and other distributions: the distribution's criu, if >= 4.2.
#
# Idempotent: when a working criu >= 4.2 is already there it only checks and exits (an older one,
# such as an earlier run's 4.1.1, is replaced).
# See docs/operations-criu.md.
#
# Two more modes, for machines that reach no network (tests/gpu/device-check.sh):
#   install-criu.sh --download-debs DIR   download the packages below into DIR (no root; apt runs
#                                         on a private state; any Debian/Ubuntu with apt)
#   install-criu.sh --from-debs DIR       the private prefix from those files instead of apt, on
#                                         any amd64 Linux (run as root; no network, no apt, /etc
#                                         untouched)
# GPUSNAP_CRIU_PREFIX and GPUSNAP_CRIU_WRAPPER move the prefix and the wrapper (e.g. under /tmp).
set -euo pipefail

PREFIX=${GPUSNAP_CRIU_PREFIX:-/opt/gpusnap/criu}
WRAPPER=${GPUSNAP_CRIU_WRAPPER:-/usr/local/sbin/criu}
MIN_VERSION=4.2
work=
TRIXIE_SOURCES=/etc/apt/sources.list.d/gpusnap-trixie.sources
TRIXIE_PIN=/etc/apt/preferences.d/gpusnap-trixie
SID_SOURCES=/etc/apt/sources.list.d/gpusnap-sid.sources
SID_PIN=/etc/apt/preferences.d/gpusnap-sid
# From Debian unstable: criu 4.2.1 and what it needs at a version trixie lacks.
SID_PACKAGES=(criu libcompel1 libnet9 libnl-3-200)
# From Debian 13: the rest of the closure of their Depends (the private loader resolves every
# library inside the prefix; the check below fails the install if one resolves outside it).
TRIXIE_PACKAGES=(
  libc6 libgcc-s1 gcc-14-base libbsd0 libmd0 libgnutls30t64 libgmp10 libhogweed6t64
  libnettle8t64 libidn2-0 libunistring5 libp11-kit0 libffi8 libtasn1-6 libnftables1 libjansson4
  libmnl0 libnftnl11 libxtables12 libprotobuf-c1 libuuid1
)

log() { echo "install-criu: $*" >&2; }
die() {
  log "error: $*"
  exit 1
}

# Prints "MAJOR.MINOR[.PATCH]" of a criu binary, or nothing when it does not run.
criu_version() {
  "$1" --version 2>/dev/null | sed -n 's/^Version: *\([0-9][0-9.]*\).*/\1/p' | head -n1
}

# True when version $1 >= version $2 (dotted numbers).
version_ge() {
  [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]
}

# True when $1 is a criu >= MIN_VERSION that passes `criu check`.
criu_works() {
  local bin=$1 ver
  [ -x "$bin" ] || return 1
  ver=$(criu_version "$bin")
  [ -n "$ver" ] || return 1
  version_ge "$ver" "$MIN_VERSION" || return 1
  "$bin" check >/dev/null 2>&1
}

summary() {
  local bin=$1 how=$2 check
  check=$("$bin" check 2>&1 | grep -v '^Warn' | tail -n1)
  echo "install-criu: criu $(criu_version "$bin") at $bin ($how): $check"
}

mode=install
debs_dir=
case "${1:-}" in
  "") ;;
  --from-debs | --download-debs)
    [ $# -eq 2 ] && [ -n "$2" ] || die "usage: $0 [--from-debs DIR | --download-debs DIR]"
    mode=${1#--}
    debs_dir=$2
    ;;
  *) die "usage: $0 [--from-debs DIR | --download-debs DIR]" ;;
esac

# --download-debs: SID_PACKAGES and TRIXIE_PACKAGES into $debs_dir, through a private apt state (no root needed).
download_debs() {
  command -v apt-get >/dev/null || die "--download-debs needs apt-get"
  [ -s /usr/share/keyrings/debian-archive-keyring.gpg ] \
    || die "missing /usr/share/keyrings/debian-archive-keyring.gpg; apt-get install debian-archive-keyring"
  mkdir -p "$debs_dir"
  work=$(mktemp -d /tmp/gpusnap-apt.XXXXXX)
  trap 'rm -rf "$work"' EXIT
  mkdir -p "$work/lists/partial" "$work/cache/archives/partial"
  local suite p specs=()
  for suite in trixie sid; do
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian $suite main"
  done >"$work/sources.list"
  for p in "${SID_PACKAGES[@]}"; do specs+=("$p/sid"); done
  for p in "${TRIXIE_PACKAGES[@]}"; do specs+=("$p/trixie"); done
  local apt=(-o "Dir::Etc::SourceList=$work/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
    -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o "APT::Architecture=amd64"
    -o "APT::Architectures=amd64" -o "Debug::NoLocking=1" -o "APT::Sandbox::User=$(id -un)"
    -o "Dir::State::status=/dev/null" -o "Dir::Etc::Preferences=/dev/null"
    -o "Dir::Etc::PreferencesParts=/dev/null")
  apt-get "${apt[@]}" update -qq || die "apt-get update (trixie and sid, private state) failed"
  rm -f "$debs_dir"/*.deb
  (cd "$debs_dir" && apt-get "${apt[@]}" download -qq "${specs[@]}") \
    || die "apt-get download from trixie and sid failed"
  log "downloaded $(ls "$debs_dir"/*.deb | wc -l) packages ($(du -sh "$debs_dir" | cut -f1)) into $debs_dir"
}

if [ "$mode" = download-debs ]; then
  download_debs
  exit 0
fi

[ "$(id -u)" -eq 0 ] || die "must run as root (CRIU needs CAP_SYS_ADMIN); try: sudo $0"

# Fast path: something already works. Our wrapper first (it shadows an old system criu).
for cand in "$WRAPPER" "$(command -v criu 2>/dev/null || true)"; do
  if [ -n "$cand" ] && criu_works "$cand"; then
    summary "$cand" "already installed"
    exit 0
  fi
done

[ -r /etc/os-release ] && . /etc/os-release
distro_id=${ID:-unknown}
codename=${VERSION_CODENAME:-}
major=${VERSION_ID:-0}
major=${major%%.*}
PRETTY_NAME=${PRETTY_NAME:-$distro_id}
if command -v dpkg >/dev/null; then
  arch=$(dpkg --print-architecture)
else
  arch=$(uname -m)
  [ "$arch" != x86_64 ] || arch=amd64
fi

# dpkg -x, or Python's ar/tar readers where dpkg is missing (a .deb is an ar archive).
deb_extract() {
  if command -v dpkg-deb >/dev/null; then
    dpkg-deb -x "$1" "$2"
    return
  fi
  python3 - "$1" "$2" <<'PY'
import io, sys, tarfile
deb, dest = sys.argv[1], sys.argv[2]
with open(deb, "rb") as f:
    if f.read(8) != b"!<arch>\n":
        sys.exit(f"{deb}: not a .deb")
    while header := f.read(60):
        name, size = header[:16].decode().strip().rstrip("/"), int(header[48:58])
        body = f.read(size + size % 2)[:size]
        if name.startswith("data.tar"):
            if name.endswith(".zst"):
                sys.exit(f"{deb}: zstd data needs dpkg-deb")
            with tarfile.open(fileobj=io.BytesIO(body)) as t:
                t.extractall(dest, **({"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}))
            break
    else:
        sys.exit(f"{deb}: no data.tar member")
PY
}

# "Package Version" of a .deb (dpkg-deb, or the file name's package_version_arch.deb).
deb_ident() {
  if command -v dpkg-deb >/dev/null; then
    dpkg-deb --showformat='${Package} ${Version}\n' -W "$1"
  else
    basename "$1" .deb | awk -F_ '{gsub("%3a", ":", $2); print $1, $2}'
  fi
}

install_from_apt() {
  log "installing criu with apt-get ($PRETTY_NAME)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq criu >/dev/null
  local bin
  bin=$(command -v criu || true)
  [ -n "$bin" ] || die "apt-get install criu gave no criu binary"
  criu_works "$bin" || die "criu $(criu_version "$bin") from apt does not work here (need >= $MIN_VERSION and a passing 'criu check'); see docs/operations-criu.md"
  summary "$bin" "apt"
}

# Where apt already reads a "$1 main" deb source from ($1: trixie, or sid which a source may
# call unstable), other than our own file $2 ("FILE:LINE" as apt names it), or nothing. apt
# itself parses every sources format, so this is its answer.
source_elsewhere() {
  local suite=$1 ours=$2 alias=$1
  [ "$suite" != sid ] || alias=unstable
  apt-get indextargets --no-release-info \
    --format '$(TARGET_OF) $(RELEASE) $(COMPONENT) $(IDENTIFIER) $(SOURCESENTRY)' 2>/dev/null \
    | awk -v ours="$ours:" -v s="$suite" -v a="$alias" '$1 == "deb" && ($2 == s || $2 == a) &&
        $3 == "main" && $4 == "Packages" && index($5, ours) != 1 { print $5; exit }'
}

# Makes apt read suite $1 ($2: its name in words) from our sources file $3, pinned at priority 1
# in $4, unless a source for it is configured already (that one is used: a second one for the
# same suite makes apt warn "configured multiple times" on every run; ours, from an earlier run,
# goes then). The pin is written either way: apt never picks anything from $1 by itself.
add_pinned_suite() {
  local suite=$1 words=$2 sources=$3 pin=$4 configured
  configured=$(source_elsewhere "$suite" "$sources")
  if [ -n "$configured" ]; then
    log "using the $words source already configured in $configured"
    rm -f "$sources"
  elif [ ! -f "$sources" ]; then
    cat >"$sources" <<EOF
# Added by gpusnap scripts/install-criu.sh: packages from $words are
# unpacked into /opt/gpusnap/criu for a private CRIU. Pinned to priority 1 in
# $pin: apt never installs or upgrades anything
# from $suite unless asked for by name (pkg/$suite).
Types: deb
URIs: http://deb.debian.org/debian
Suites: $suite
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  fi
  cat >"$pin" <<EOF
# Added by gpusnap scripts/install-criu.sh: never pick packages from $suite on this system.
Package: *
Pin: release n=$suite
Pin-Priority: 1
EOF
}

# Debian 12 and 13: Debian unstable's criu with Debian 13's libraries, in $PREFIX.
install_private() {
  [ "$arch" = amd64 ] || die "the private CRIU supports amd64 only (this is $arch); install CRIU >= $MIN_VERSION by hand"
  log "$PRETTY_NAME: fetching Debian unstable's criu into $PREFIX (system packages are not touched)"
  [ -s /usr/share/keyrings/debian-archive-keyring.gpg ] \
    || die "missing /usr/share/keyrings/debian-archive-keyring.gpg; apt-get install debian-archive-keyring"
  # Debian 13 reads trixie already (the system's own release, never pinned down).
  [ "$major" -ge 13 ] || add_pinned_suite trixie "Debian 13 (trixie)" "$TRIXIE_SOURCES" "$TRIXIE_PIN"
  add_pinned_suite sid "Debian unstable (sid)" "$SID_SOURCES" "$SID_PIN"
  apt-get update -qq

  work=$(mktemp -d /tmp/gpusnap-criu.XXXXXX)
  trap 'rm -rf "$work"' EXIT
  chmod 755 "$work"
  chown _apt "$work" 2>/dev/null || true # apt downloads as its sandbox user

  local p specs=()
  for p in "${SID_PACKAGES[@]}"; do specs+=("$p/sid"); done
  for p in "${TRIXIE_PACKAGES[@]}"; do specs+=("$p/trixie"); done
  (cd "$work" && apt-get download -qq "${specs[@]}") || die "apt-get download from sid and trixie failed"
  install_prefix_from "$work" "Debian unstable criu in $PREFIX"
}

install_from_debs() {
  [ "$arch" = amd64 ] || die "the carried packages are amd64 (this is $arch)"
  [ -d "$debs_dir" ] || die "no folder $debs_dir"
  local p missing=()
  for p in "${SID_PACKAGES[@]}" "${TRIXIE_PACKAGES[@]}"; do
    compgen -G "$debs_dir/${p}_*.deb" >/dev/null || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] || die "$debs_dir lacks: ${missing[*]} (run $0 --download-debs $debs_dir)"
  log "unpacking Debian unstable's criu from $debs_dir into $PREFIX (no network, nothing installed)"
  install_prefix_from "$debs_dir" "Debian unstable criu in $PREFIX, from $debs_dir"
}

# Unpacks every .deb of $1 into $PREFIX (through $PREFIX.new), checks that criu resolves every
# library inside it, writes $WRAPPER and checks it ($2: how, for the summary).
install_prefix_from() {
  local src=$1 how=$2 staging deb
  staging=$PREFIX.new
  rm -rf "$staging"
  mkdir -p "$staging" "$(dirname "$WRAPPER")"
  for deb in "$src"/*.deb; do deb_extract "$deb" "$staging" || die "cannot unpack $deb"; done
  for deb in "$src"/*.deb; do deb_ident "$deb"; done | sort >"$staging/PACKAGES"
  rm -rf "$staging/usr/share/doc" "$staging/usr/share/man" "$staging/usr/share/locale"

  local libdir=$staging/usr/lib/x86_64-linux-gnu ld
  ld=$libdir/ld-linux-x86-64.so.2
  [ -x "$ld" ] || die "trixie's libc6 gave no loader at $ld"
  # Every library must come from the prefix: a bookworm library next to trixie's libc is a trap.
  local outside
  outside=$("$ld" --library-path "$libdir" --list "$staging/usr/sbin/criu" \
    | awk '/=>/ && $3 !~ "^'"$staging"'/" {print $1}') \
    || die "the criu in $src does not load with its libraries (run $0 --download-debs DIR again)"
  [ -z "$outside" ] || die "libraries resolved outside $PREFIX: $outside (add their trixie packages to TRIXIE_PACKAGES)"
  # Checked before anything is replaced: an old folder of .debs must not downgrade a working one.
  local ver
  ver=$("$ld" --library-path "$libdir" "$staging/usr/sbin/criu" --version 2>/dev/null \
    | sed -n 's/^Version: *\([0-9][0-9.]*\).*/\1/p' | head -n1)
  [ -n "$ver" ] && version_ge "$ver" "$MIN_VERSION" \
    || die "the criu in $src is ${ver:-unreadable}, not >= $MIN_VERSION (run $0 --download-debs DIR again)"

  rm -rf "$PREFIX.old"
  [ ! -e "$PREFIX" ] || mv "$PREFIX" "$PREFIX.old"
  mv "$staging" "$PREFIX"
  rm -rf "$PREFIX.old"

  local tmp_wrapper=$WRAPPER.tmp.$$
  cat >"$tmp_wrapper" <<EOF
#!/bin/sh
# Installed by gpusnap scripts/install-criu.sh: Debian unstable's CRIU with Debian 13's
# libraries, unpacked in $PREFIX, run through that prefix's own dynamic loader and libraries
# (the system's glibc and libnl may be too old for it).
# --library-path applies to criu alone; the programs criu runs get the normal environment.
P=$PREFIX
L=\$P/usr/lib/x86_64-linux-gnu
exec "\$L/ld-linux-x86-64.so.2" --library-path "\$L" --argv0 criu "\$P/usr/sbin/criu" "\$@"
EOF
  chmod 755 "$tmp_wrapper"
  mv "$tmp_wrapper" "$WRAPPER"

  criu_works "$WRAPPER" || die "$WRAPPER does not work: $("$WRAPPER" check 2>&1 | tail -n1)"
  summary "$WRAPPER" "$how"
}

if [ "$mode" = from-debs ]; then
  install_from_debs
  exit 0
fi

case "$distro_id:$major:$codename" in
  debian:12:* | debian:*:bookworm | debian:13:* | debian:*:trixie) install_private ;;
  debian:*)
    # testing and sid: the distribution's criu is new enough.
    install_from_apt
    ;;
  *)
    log "not Debian ($PRETTY_NAME): trying the distribution's criu"
    install_from_apt
    ;;
esac
