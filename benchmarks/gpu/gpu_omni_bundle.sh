#!/bin/bash
# The omni bundle (issue #35 §2): vLLM-Omni 0.26.0 and what it needs that the offline GPU host lacks, in
# the piece format of gpu_site_bundle.sh (which it goes beside: that bundle brings vLLM 0.26.0 itself).
#   bash benchmarks/gpu/gpu_omni_bundle.sh DIR     (DIR an ignored folder of the checkout, e.g. .gpu-carry-omni/)
#   DIR/o0, DIR/o1, ...  one folder per device call, each one piece of omni.tar (+ its sha256 in the last):
#       omni-site.tar.xz  the packages below installed for cp312, xz-compressed
# There: `gpu_install.sh stash DIR/oN` per folder, then `gpu_install.sh install-omni` (unpacks to $H8/omni-site).
#
# vllm-omni 0.26.0's requirements and what is done with each (its METADATA; the host's list in
# .library/device/KINDS.md; the main bundle's in gpu_site_bundle.sh):
#   carried (imported on the path of AsyncOmni, an LLM stage and a diffusion stage): diffusers==0.38.0 (pinned),
#     cache-dit==1.3.0 (pinned; the diffusion model runner imports it), omegaconf (the stage-config loader;
#     2.4.0 needs only PyYAML, 2.3 would need antlr4), janus (the orchestrator's queues), aenum==3.1.16 (pinned;
#     vllm_omni.patch), prettytable + wcwidth (vllm_omni.metrics), torchsde + trampoline (small; AudioX's
#     pipeline module imports it)
#   on the host already: transformers>=5.5.3 (5.17.0), safetensors>=0.8.0, einops, tqdm, msgpack, onnxruntime,
#     imageio, pillow; in the main bundle: pyzmq, pydantic, pydantic-settings, gguf, loguru
#   accelerate==1.12.0 (pinned): the host's 1.15.0 is kept (only one speech model's vocoder imports it;
#     diffusers uses it optionally and works with 1.15)
#   left out, each an optional import for models the proof does not run: av (video muxing, AudioX; 35 MB),
#     imageio[ffmpeg] (68 MB), fa3-fwd==0.0.3 (FlashAttention-3 for diffusion attention, 28 MB; without it the
#     diffusion attention falls back to SDPA), openai-whisper (MagiHuman), x-transformers (speech DiTs),
#     soundfile (speech and singing models; it needs cffi, which the host lacks too)
set -euo pipefail
DIR=${1:?usage: gpu_omni_bundle.sh DIR}
PY=${PYTHON:-python3}
mkdir -p "$DIR/wheels"
source "$(dirname "$0")/bundle_lib.sh"  # PLAT, cut_pieces
cat > "$DIR/requirements.txt" <<'EOF'
vllm-omni==0.26.0
diffusers==0.38.0
cache-dit==1.3.0
omegaconf==2.4.0
janus==2.0.0
aenum==3.1.16
prettytable==3.18.0
wcwidth==0.9.4
torchsde==0.2.6
trampoline==0.1.2
EOF
"$PY" -m pip download --no-deps "${PLAT[@]}" -d "$DIR/wheels" -r "$DIR/requirements.txt"
rm -rf "$DIR/site"
"$PY" -m pip install -q --no-deps --no-compile "${PLAT[@]}" --target "$DIR/site" "$DIR"/wheels/*.whl
STAGE="$DIR/stage"
rm -rf "$STAGE" "$DIR"/o[0-9]* && mkdir -p "$STAGE"
tar -C "$DIR/site" -cf - . | xz -T2 -6 > "$STAGE/omni-site.tar.xz"
cut_pieces "$DIR" "$STAGE" omni o
