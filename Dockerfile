# One image for every CPU service (engine prefill/decode/both, router, doctor); the command picks the role.
# Built offline: the base is a build argument and Python packages come from the host's wheelhouse
# (.cache/wheels, made by scripts/wheelhouse.sh). Classic builder compatible: no syntax directive.
ARG BASE_IMAGE=python:3.11-slim

# The virtualenv is built in a stage of its own and copied over, so the wheelhouse and the files removed below
# never become layers of the image.
# The engine's weight matmuls use oneMKL (stack/engine/gemm.py) with intel-openmp's threads: the `mkl` wheel and its
# dependencies bring ~1 GB of libraries into /opt/venv/lib, of which the engine loads the single dynamic library,
# LP64, intel-openmp threading, the core, the vector math and one CPU-specific pair per CPU family (all families
# are kept: MKL picks one at run time and stops the process if it is missing) and tbbmalloc; and oneTBB's runtime,
# numba's threading layer (stack/engine/batched_decode.py). The rest (GPU offload, MPI, ILP64, MKL's other
# threading layers, static and debug files) is removed.
FROM ${BASE_IMAGE} AS venv
COPY .cache/wheels /tmp/wheels
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-index --no-cache-dir --disable-pip-version-check \
        --find-links /tmp/wheels -r /tmp/wheels/requirements.txt \
 && cd /opt/venv/lib \
 && rm -rf cmake pkgconfig *.a *.dbg libarcher* libomptarget* libur_* libumf* libtcm* libhwloc* libtbb.so libtbbbind* \
        libtbbmalloc_proxy* libiompstubs5* libiomp5_db* libmkl_*ilp64* libmkl_gf_* libmkl_scalapack* libmkl_blacs* \
        libmkl_cdft* libmkl_sequential* libmkl_gnu_thread* libmkl_tbb_thread*

FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title=pd-deploy

ENV LANG=C.UTF-8 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONPATH=/app \
    PATH=/opt/venv/bin:$PATH

COPY --from=venv /opt/venv /opt/venv
RUN useradd --system --uid 10001 --no-create-home pd \
 && mkdir -p /app/data && chown pd /app/data

WORKDIR /app
# The engine's attention kernel (stack/engine/kernels.py), compiled here into numba's cache so an engine loads it
# at warm-up instead of compiling it (seconds). Only that file and the package markers are copied first: a code
# change elsewhere reuses this layer. The cache is keyed by the file's content and this machine's CPU (an image
# run on another CPU compiles at warm-up); pd owns the directory, as numba wants it writable.
ENV NUMBA_CACHE_DIR=/app/numba-cache
COPY stack/__init__.py /app/stack/__init__.py
COPY stack/engine/__init__.py stack/engine/kernels.py /app/stack/engine/
RUN python -c "from stack.engine.kernels import compile_kernel; compile_kernel()" \
 && chown -R pd /app/numba-cache
COPY stack /app/stack
COPY doctor /app/doctor
# No configs in the image: every service reads its config from /config, a read-only mount of the
# deployment's prefill/, decode/, colocated/ or router/ folder, so a config edit needs a restart, not a
# rebuild, and no baked-in copy can drift from the files on the host.
# The router keeps per-key usage in /app/data (a named volume in compose); everything else is read-only.
USER pd
