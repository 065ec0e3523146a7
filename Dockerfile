# shardserve on the official Ray GPU image (CUDA, Python 3.11, Ray matching pyproject's ray[serve]).
# Build: docker build -t shardserve:0.1.0 .
# The image carries code only; models are mounted at /models (see docs/OPERATIONS.md).
#checkov:skip=CKV_DOCKER_2: Kubernetes ignores HEALTHCHECK; the RayService probes GET /health on port 8000
FROM rayproject/ray:2.60.0-py311-gpu

# The Ray image's default user: uid 1000, owner of its Python environment.
USER ray
WORKDIR /home/ray/shardserve

ENV HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# .dockerignore admits only the package sources, pyproject.toml and configs/.
COPY --chown=ray:users . .
# Ray itself is already installed at the pinned version, which satisfies ray[serve]>=2.40,<3.
# The server's extra only: the `bench` extra (load-test client, matplotlib) stays out of the image.
RUN pip install ".[serve]" \
    && python -c "import app.cli, engine.config, ray; print('ray', ray.__version__)"

EXPOSE 8000
CMD ["shardserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
