# Sourced by gpu_site_bundle.sh and gpu_omni_bundle.sh (bash): what both bundles share.
# PLAT: pip's flags for the GPU hosts' wheels (CPython 3.12 on x86-64 Linux).
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform any)
for n in 17 24 27 28 31 34 35; do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
PLAT+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)

# cut_pieces DIR STAGE NAME PREFIX: the stage folder as pieces that each fit one device call beside this
# checkout's tracked files (64 MiB per call in all): DIR/PREFIX0, DIR/PREFIX1, ... each holding a piece
# NAME.tar.partNN (the last also NAME.tar.sha256), which gpu_install.sh stashes one call each and joins.
# PIECE_MIB overrides the piece size.
cut_pieces() {
  local dir=$1 stage=$2 name=$3 prefix=$4 here tree_mib piece_mib part last i=0
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
  tree_mib=$(git -C "$here" ls-files -z | (cd "$here" && xargs -0 du -cb) | tail -1 | awk '{print int($1/1048576)+1}')
  piece_mib=${PIECE_MIB:-$((64 - tree_mib - 2))}
  rm -rf "$dir/$prefix"[0-9]*
  tar -C "$stage" -cf "$dir/$name.tar" .
  (cd "$dir" && split -b "${piece_mib}M" -d "$name.tar" "$name.tar.part" && sha256sum "$name.tar" > "$name.tar.sha256" && rm "$name.tar")
  for part in "$dir/$name".tar.part*; do
    mkdir -p "$dir/$prefix$i" && mv "$part" "$dir/$prefix$i/"
    last="$dir/$prefix$i"
    i=$((i+1))
  done
  mv "$dir/$name.tar.sha256" "$last/"
  echo "pieces of ${piece_mib} MiB (tracked tree ${tree_mib} MiB): one device call per folder"
  du -sh "$dir/$prefix"[0-9]*
}
