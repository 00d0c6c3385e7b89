# One image for the worker and the API (the command picks which).
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md worker.py ./
COPY roundtable ./roundtable
COPY workflows ./workflows
COPY activities ./activities
COPY api ./api
# procps: the worker's healthcheck looks for its process.
RUN apt-get update && apt-get install -y --no-install-recommends procps \
    && rm -rf /var/lib/apt/lists/* \
    && pip install --no-cache-dir . && useradd --system --uid 10001 roundtable
USER roundtable
EXPOSE 8000
CMD ["roundtable", "--help"]
