#!/usr/bin/env bash
# The peers' side environments for benchmarks/bench_dataframe.py (issue 41): one venv each under
# PEER_VENVS (default /work/peer-venvs), reused when present. Never the project's venv: Petastorm
# 0.13.1 imports pyarrow.filesystem (pyarrow <= 14), which PySpark 4 (pyarrow >= 18) cannot run
# beside, so both peers run on PySpark 3.5 (Mosaic Streaming's own `spark` extra asks for pyspark < 4).
#
#   bash benchmarks/peers/setup.sh [petastorm] [streaming]      # both when none is named
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PEER_VENVS="${PEER_VENVS:-/work/peer-venvs}"
PYTHON="${PYTHON:-python3.11}"
PEERS=("$@")
[ ${#PEERS[@]} -eq 0 ] && PEERS=(petastorm streaming)

# torch==2.13.0 is the CPU build on this machine's wheel shelf (pip's find-links)
COMMON=("torch==2.13.0" "pyspark==3.5.5" "numpy==1.26.4" "pandas==2.2.3")

make_venv() {  # NAME: the venv, made once; .ready marks a finished install
    local venv="$PEER_VENVS/$1"
    [ -f "$venv/.ready" ] && return 1
    rm -rf "$venv" && mkdir -p "$PEER_VENVS" && "$PYTHON" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
    return 0
}

for peer in "${PEERS[@]}"; do
    venv="$PEER_VENVS/$peer"
    case "$peer" in
    petastorm)
        if make_venv petastorm; then
            "$venv/bin/pip" install -q "${COMMON[@]}" "pyarrow==14.0.2"
            # petastorm's own metadata pins setuptools<70; what it imports is installed by hand
            "$venv/bin/pip" install -q dill diskcache future fsspec packaging psutil pyzmq six
            "$venv/bin/pip" install -q --no-deps "petastorm==0.13.1"
            touch "$venv/.ready"
        fi
        ;;
    streaming)
        if make_venv streaming; then
            "$venv/bin/pip" install -q "${COMMON[@]}" "pyarrow==17.0.0"
            # what `import streaming` and its DataFrame path import (not the cloud SDKs, not torchvision:
            # PyPI's torchvision wants CUDA beside a CPU torch)
            "$venv/bin/pip" install -q brotli python-snappy zstd xxhash catalogue filelock pillow tqdm \
                "transformers<5" typing_extensions
            "$venv/bin/pip" install -q --no-deps "mosaicml-streaming==0.13.0"
            touch "$venv/.ready"
        fi
        # streaming.vision imports three torchvision names at `import streaming`: a stand-in with
        # only those, put on this venv's path (rewritten every time: it names this checkout)
        site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
        echo "$HERE/standin" > "$site/bench_torchvision_standin.pth"
        ;;
    *)
        echo "unknown peer: $peer (petastorm, streaming)" >&2
        exit 2
        ;;
    esac
    "$venv/bin/python" -c "import $peer, pyspark, pyarrow, numpy, torch; print('$peer', $peer.__version__ if hasattr($peer, '__version__') else '', 'pyspark', pyspark.__version__, 'pyarrow', pyarrow.__version__, 'numpy', numpy.__version__, 'torch', torch.__version__)"
done
