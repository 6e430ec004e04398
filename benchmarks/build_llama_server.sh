#!/usr/bin/env bash
# Build llama.cpp's C++ `llama-server` for the edgellm vs llama.cpp benchmark.
#
# The llama.cpp source comes from the llama-cpp-python sdist on PyPI (it vendors
# llama.cpp under vendor/llama.cpp), so only a Python package registry is
# needed. Everything is kept outside the repository:
#
#   ${EDGELLM_CACHE:-$HOME/.cache/edgellm}/llama.cpp/
#       sdist/                     downloaded llama-cpp-python sdist
#       src/                       unpacked sdist
#       build/bin/llama-server     the binary (symlink into the build tree)
#
# The script is idempotent: when the binary already exists and was built with
# the same version and options (recorded in build/build.stamp) it only prints
# its path. The build takes about 20 minutes on 2 cores; run it at low priority:
#
#   nice -n 19 bash benchmarks/build_llama_server.sh
#
# Environment:
#   EDGELLM_CACHE         cache root (default: $HOME/.cache/edgellm)
#   LLAMA_CPP_PY_VERSION  llama-cpp-python version to take the source from
#   BUILD_JOBS            parallel compile jobs (default: 2)
#   PYTHON                Python used for pip (default: the repo venv, else python3)
#   LLAMA_AMX             1 keeps ggml's AMX matmul path (default: 0, disabled; see below)
#
# AMX: with GGML_NATIVE=ON on a CPU that advertises AMX, ggml builds its AMX
# matmul path and picks it for Q4_0/Q4_1/Q8_0 weights. That path crashes in
# ggml_backend_amx_mul_mat (SIGSEGV at ldtilecfg, or SIGILL) on the first
# forward pass on the project's 2-core Xeon machines, a known upstream problem
# (llama.cpp issue 20824). The build therefore undefines the AMX feature
# macros, which leaves -march=native (AVX-512, VNNI, BF16) and the CPU weight
# repacking in place. (A build with AMX also runs when llama-server is given
# --no-repack, which turns off all extra weight layouts, repacking included.)
#
# The last line printed on success is the absolute path of llama-server.
set -euo pipefail

LLAMA_CPP_PY_VERSION="${LLAMA_CPP_PY_VERSION:-0.3.36}"
BUILD_JOBS="${BUILD_JOBS:-2}"
CACHE_ROOT="${EDGELLM_CACHE:-$HOME/.cache/edgellm}"
BASE="$CACHE_ROOT/llama.cpp"
BIN="$BASE/build/bin/llama-server"

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

log() { echo "[build_llama_server] $*" >&2; }

LLAMA_AMX="${LLAMA_AMX:-0}"
NO_AMX_FLAGS=""
if [[ "$LLAMA_AMX" != "1" ]]; then
    NO_AMX_FLAGS="-U__AMX_TILE__ -U__AMX_INT8__ -U__AMX_BF16__"
fi
CMAKE_ARGS=(
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
    "-DCMAKE_C_FLAGS=$NO_AMX_FLAGS" "-DCMAKE_CXX_FLAGS=$NO_AMX_FLAGS"
)
STAMP="$BASE/build/build.stamp"
STAMP_TEXT="llama-cpp-python==$LLAMA_CPP_PY_VERSION ${CMAKE_ARGS[*]}"

if [[ -x "$BIN" && -x "$(dirname "$BIN")/llama-bench" && -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_TEXT" ]]; then
    log "already built"
    echo "$BIN"
    exit 0
fi

# Refuse to place the cache inside the repository.
case "$(realpath -m "$BASE")/" in
    "$REPO_ROOT"/*)
        log "error: cache dir $BASE is inside the repository; set EDGELLM_CACHE elsewhere"
        exit 2 ;;
esac

if [[ -n "${PYTHON:-}" ]]; then
    PY="$PYTHON"
elif [[ -x "$REPO_ROOT/.venv/bin/python" ]]; then
    PY="$REPO_ROOT/.venv/bin/python"
else
    PY="$(command -v python3)"
fi

# Toolchain checks.
CXX_BIN="${CXX:-}"
if [[ -z "$CXX_BIN" ]]; then
    for c in c++ g++ clang++; do
        if command -v "$c" >/dev/null 2>&1; then CXX_BIN="$(command -v "$c")"; break; fi
    done
fi
if [[ -z "$CXX_BIN" ]]; then
    log "error: no C++ compiler found (install g++, e.g. apt-get install g++)"
    exit 2
fi
log "C++ compiler: $CXX_BIN ($("$CXX_BIN" --version | head -n1))"

CMAKE_BIN="$(command -v cmake || true)"
if [[ -z "$CMAKE_BIN" ]]; then
    PY_BIN_DIR="$(dirname "$PY")"
    if [[ -x "$PY_BIN_DIR/cmake" ]]; then
        CMAKE_BIN="$PY_BIN_DIR/cmake"
    else
        log "cmake not found; installing it with pip into $("$PY" -c 'import sys; print(sys.prefix)')"
        "$PY" -m pip install --quiet cmake
        CMAKE_BIN="$PY_BIN_DIR/cmake"
    fi
fi
log "cmake: $CMAKE_BIN ($("$CMAKE_BIN" --version | head -n1))"

mkdir -p "$BASE/sdist" "$BASE/src"

# Fetch the sdist (source only, no dependencies).
SDIST="$(ls "$BASE/sdist"/llama_cpp_python-"$LLAMA_CPP_PY_VERSION".tar.gz 2>/dev/null || true)"
if [[ -z "$SDIST" ]]; then
    log "downloading llama-cpp-python==$LLAMA_CPP_PY_VERSION sdist"
    "$PY" -m pip download --quiet --no-binary :all: --no-deps \
        -d "$BASE/sdist" "llama-cpp-python==$LLAMA_CPP_PY_VERSION"
    SDIST="$(ls "$BASE/sdist"/llama_cpp_python-"$LLAMA_CPP_PY_VERSION".tar.gz)"
fi

SRC="$BASE/src/llama_cpp_python-$LLAMA_CPP_PY_VERSION"
if [[ ! -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ]]; then
    log "unpacking $SDIST"
    rm -rf "$SRC"
    tar -xzf "$SDIST" -C "$BASE/src"
fi
LLAMA_DIR="$SRC/vendor/llama.cpp"
if [[ ! -f "$LLAMA_DIR/CMakeLists.txt" ]]; then
    log "error: $LLAMA_DIR/CMakeLists.txt missing in the sdist"
    exit 1
fi

BUILD_DIR="$LLAMA_DIR/build"
log "configuring in $BUILD_DIR"
"$CMAKE_BIN" -S "$LLAMA_DIR" -B "$BUILD_DIR" -DCMAKE_CXX_COMPILER="$CXX_BIN" "${CMAKE_ARGS[@]}"

log "building llama-server and llama-bench with -j $BUILD_JOBS"
START=$(date +%s)
"$CMAKE_BIN" --build "$BUILD_DIR" --target llama-server llama-bench -j "$BUILD_JOBS"
log "build took $(( $(date +%s) - START )) s"

BUILT="$BUILD_DIR/bin/llama-server"
if [[ ! -x "$BUILT" ]]; then
    BUILT="$(find "$BUILD_DIR" -type f -name llama-server -perm -u+x | head -n1)"
fi
if [[ -z "$BUILT" || ! -x "$BUILT" ]]; then
    log "error: build finished but no llama-server binary was found under $BUILD_DIR"
    exit 1
fi

mkdir -p "$(dirname "$BIN")"
ln -sfn "$BUILT" "$BIN"
if [[ -x "$(dirname "$BUILT")/llama-bench" ]]; then  # prompt processing: benchmarks/offline_throughput.py
    ln -sfn "$(dirname "$BUILT")/llama-bench" "$(dirname "$BIN")/llama-bench"
fi
echo "$STAMP_TEXT" > "$STAMP"
"$BIN" --version >&2 || true
echo "$BIN"
