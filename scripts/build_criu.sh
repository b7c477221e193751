#!/usr/bin/env bash
# Builds CRIU >= 4.1 once into a cache folder and prints the binary's path (a second run prints it at once).
# Why: Debian bookworm's criu 3.17.1 cannot start on kernels >= 6.13 (the vDSO data area is split in two
# mappings, handled from CRIU 4.1 on; see docs/benchmarks/lifecycle.md "Checkpoint / restore"). The source is
# Debian unstable's criu source package (4.2.1 when written), found with apt-get through a private
# sources list on the system's own Debian archive (the system's apt sources are left as they are); the build's libraries come from the
# system's own release. Cache: $TURBINE_CRIU_CACHE (default ~/.cache/turbine/criu)/criu.
# Needs root (apt-get) and Debian's archive; about 1-2 min on 2 cores, once.
set -euo pipefail
CACHE=${TURBINE_CRIU_CACHE:-$HOME/.cache/turbine/criu}
OUT=$CACHE/criu
if [ -x "$OUT" ]; then echo "$OUT"; exit 0; fi
mkdir -p "$CACHE"
exec 9>"$CACHE/.build.lock"
flock 9  # two builders at once: the second waits and takes the first's binary
if [ -x "$OUT" ]; then echo "$OUT"; exit 0; fi
PKGS="protobuf-c-compiler libprotobuf-c-dev libprotobuf-dev protobuf-compiler python3-protobuf libnl-3-dev
      libnet1-dev libcap-dev libbsd-dev libnftables-dev pkg-config gcc make xz-utils"
missing=$(for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
if [ -n "$missing" ]; then
  echo "build_criu: installing $(echo $missing)" >&2
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing) >&2
fi
WORK=$(mktemp -d "$CACHE/build.XXXX")
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/apt/lists/partial" "$WORK/apt/cache/archives/partial" "$WORK/src"
chmod -R a+rx "$WORK"
# The system's own Debian archive (the one its release's packages come from), suite unstable.
mirror=$(apt-get indextargets --format '$(REPO_URI) $(RELEASE)' 'Created-By: Packages' 2>/dev/null |
         awk '$2 !~ /-(security|updates|backports)$/ {print $1; exit}')
[ -n "$mirror" ] || { echo "build_criu: no Debian archive in the system's apt sources" >&2; exit 1; }
echo "deb-src ${mirror%/} sid main" >"$WORK/apt/sources.list"
APT=(-o Dir::Etc::sourcelist="$WORK/apt/sources.list" -o Dir::Etc::sourceparts=/dev/null
     -o Dir::State::Lists="$WORK/apt/lists" -o Dir::Cache="$WORK/apt/cache")
apt-get "${APT[@]}" update -qq 2>/dev/null >&2
# Only the upstream tarball is needed (Debian's packaging is not): its address and hash from the index,
# fetched by apt's own downloader, which checks the hash.
read -r url name _size hash < <(apt-get "${APT[@]}" --print-uris source -qq criu 2>/dev/null | tr -d "'" | grep '\.orig\.tar\.' | head -1)
/usr/lib/apt/apt-helper download-file "$url" "$WORK/src/$name" "$hash" >/dev/null 2>&1
tarball=$WORK/src/$name
version=$(echo "$name" | sed -E 's/^criu_([0-9.]+)\.orig.*/\1/')
case "$version" in 3.*|4.0*) echo "build_criu: Debian's criu source is $version; >= 4.1 is needed" >&2; exit 1;; esac
tar -xf "$tarball" -C "$WORK/src"
dir=$(find "$WORK/src" -mindepth 1 -maxdepth 1 -type d -name 'criu*' | head -1)
echo "build_criu: building CRIU $version" >&2
make -C "$dir" -j"$(nproc)" criu >"$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log" >&2; exit 1; }
cp "$dir/criu/criu" "$OUT.tmp" && mv "$OUT.tmp" "$OUT"
echo "$version" >"$CACHE/VERSION"
echo "$OUT"
