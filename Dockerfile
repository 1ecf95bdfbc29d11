# One image for every specloop process in docker-compose.yml: Ray nodes, `specloop serve`,
# `specloop api`. CPU build of torch; models are mounted at /models, not baked in.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, from the CPU index: resolving it from PyPI pulls the CUDA build (gigabytes more).
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /app
COPY pyproject.toml README.md ./
COPY drafter drafter
COPY trainer trainer
COPY services services
COPY specloop specloop
# the project (pins torch==2.13.0, already satisfied), Ray and the serving stack
RUN pip install . && specloop --help >/dev/null

# every process runs as an unprivileged user; the registry volume starts out owned by it
RUN useradd --create-home --uid 10001 specloop \
    && mkdir -p /models /var/lib/specloop/registry && chown specloop:specloop /var/lib/specloop/registry
USER specloop
EXPOSE 8000
CMD ["specloop", "--help"]
