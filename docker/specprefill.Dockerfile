# The gateway and the draft worker (one image, two commands).
# TORCH_INDEX picks the torch build: CUDA wheels by default; https://download.pytorch.org/whl/cpu for CPU-only gateways.
FROM python:3.11.11-slim-bookworm

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 HF_HOME=/models/hf

RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
WORKDIR /app
COPY pyproject.toml README.md ./
COPY common ./common
COPY gateway ./gateway
COPY draft_worker ./draft_worker
COPY engine ./engine
COPY specprefill ./specprefill
RUN pip install .

RUN useradd --create-home --uid 10001 specprefill && mkdir -p /models && chown specprefill /models
USER specprefill
EXPOSE 8000 8002
ENTRYPOINT ["specprefill"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
