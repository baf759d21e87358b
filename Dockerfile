# One image for every CPU service (engine prefill/decode/both, router, doctor); the command picks the role.
# Built offline: the base is a build argument and Python packages come from the host's wheelhouse
# (.cache/wheels, made by scripts/wheelhouse.sh). Classic builder compatible: no syntax directive.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title=pd-deploy

ENV LANG=C.UTF-8 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONPATH=/app \
    PATH=/opt/venv/bin:$PATH

COPY .cache/wheels /tmp/wheels
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-index --no-cache-dir --disable-pip-version-check \
        --find-links /tmp/wheels -r /tmp/wheels/requirements.txt \
 && rm -rf /tmp/wheels \
 && useradd --system --uid 10001 --no-create-home pd \
 && mkdir -p /app/data && chown pd /app/data

WORKDIR /app
COPY stack /app/stack
COPY doctor /app/doctor
# No configs in the image: every service reads its config from /config, a read-only mount of the
# deployment's prefill/, decode/, colocated/ or router/ folder, so a config edit needs a restart, not a
# rebuild, and no baked-in copy can drift from the files on the host.
# The router keeps per-key usage in /app/data (a named volume in compose); everything else is read-only.
USER pd
