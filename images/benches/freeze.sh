#!/usr/bin/env bash
# Freeze benchmark (not part of the test suite). Builds a container filesystem of about 1 GiB of
# mixed files (many small text files, large compressible files, random incompressible files,
# symlinks, hard links) in a container of the dev image, then in the same run:
#   ours       docker export C | freeze_stdin STORE          (filter + tar2sqfs + SIF, streaming)
#   reference  docker export C > x.tar; tar -xf x.tar -C r; mksquashfs r out.sqfs -comp gzip
#              -noappend -processors 2
# and prints wall times, their ratio and peak memory (ours: the freeze process and tar2sqfs,
# each and summed; reference: the largest step). Removes everything it made.
#
# Usage: images/benches/freeze.sh
# Environment:
#   ONGRID_BENCH_MIB   approximate size of the generated data in MiB (default 800; the dev image
#                      adds ~240 MiB)
#   ONGRID_BENCH_RUNS  runs of each path, alternating; the best wall time of each is compared
#                      (default 2)
#   TMPDIR             where the work directory goes (default /var/tmp)
# Needs: root, Docker, cargo, squashfs-tools, squashfs-tools-ng, GNU time (package `time`).
set -euo pipefail

readonly IMAGE=ongrid/dev:latest
readonly DATA_MIB="${ONGRID_BENCH_MIB:-800}"
readonly RUNS="${ONGRID_BENCH_RUNS:-2}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
readonly ROOT
WORK="$(mktemp -d "${TMPDIR:-/var/tmp}/ongrid-freeze-bench.XXXXXX")"
readonly WORK
readonly CONTAINER="ongrid-freeze-bench-$$"

say() { printf '==> %s\n' "$*" >&2; }
die() {
    printf 'error: %s\n' "$*" >&2
    exit 1
}

cleanup() {
    docker rm -f "$CONTAINER" >/dev/null 2>&1 || true
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Seconds since the epoch with nanoseconds.
now() { date +%s.%N; }
# Seconds elapsed since $1 (a `now` value).
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }

# The smaller of two decimal numbers; an empty first one means none yet.
min() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "" || b + 0 < a + 0) print b; else print a }'; }

# "Maximum resident set size (kbytes): N" from a GNU time -v report.
peak_kib() { awk -F': ' '/Maximum resident set size/ { print $2 }' "$1"; }

# The generator, run with the image's python3 inside the container. Sizes scale with $1 (MiB).
# shellcheck disable=SC2016 # the Python program is single-quoted on purpose
readonly GENERATOR='
import os, random, sys
mib = int(sys.argv[1])
rng = random.Random(42)
words = [bytes(rng.choice(b"abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
def text(n):
    out = bytearray()
    while len(out) < n:
        out += b" ".join(rng.choice(words) for _ in range(12)) + b"\n"
    return bytes(out[:n])
base = "/data"
small_budget = mib * 30 // 100 * 1024 * 1024
large_budget = mib * 45 // 100 * 1024 * 1024
random_budget = mib * 25 // 100 * 1024 * 1024
# Many small text files (1-12 KiB), 200 per directory.
written, i = 0, 0
while written < small_budget:
    d = f"{base}/src/pkg{i // 200:04d}"
    if i % 200 == 0:
        os.makedirs(d)
    data = text(rng.randint(1024, 12 * 1024))
    with open(f"{d}/module{i:06d}.py", "wb") as f:
        f.write(data)
    written += len(data); i += 1
small_files = i
# Large compressible files (logs, CSV): 64 MiB each.
os.makedirs(f"{base}/large")
chunk = text(4 * 1024 * 1024)
for n in range(max(1, large_budget // (64 * 1024 * 1024))):
    with open(f"{base}/large/log{n}.txt", "wb") as f:
        for k in range(16):
            f.write(chunk[k:] + chunk[:k])
# Random incompressible files (model weights, archives): 32 MiB each.
os.makedirs(f"{base}/weights")
for n in range(max(1, random_budget // (32 * 1024 * 1024))):
    with open(f"{base}/weights/shard{n}.bin", "wb") as f:
        f.write(os.urandom(32 * 1024 * 1024))
# Symlinks and hard links to the small files.
os.makedirs(f"{base}/links")
for n in range(0, small_files, 20):
    target = f"{base}/src/pkg{n // 200:04d}/module{n:06d}.py"
    os.symlink(target, f"{base}/links/sym{n:06d}")
    os.link(target, f"{base}/links/hard{n:06d}")
print(f"{small_files} small files", file=sys.stderr)
'

main() {
    [[ "$(id -u)" -eq 0 ]] || die "run as root (the reference unpack keeps ownership)"
    local tool
    for tool in docker cargo mksquashfs tar2sqfs /usr/bin/time; do
        command -v "$tool" >/dev/null || die "$tool not found: install it (see .ci/run)"
    done
    docker info >/dev/null 2>&1 || die "cannot reach the Docker daemon"

    say "dev image"
    "$ROOT/images/dev/build.sh" >&2
    say "building the example (release)"
    (cd "$ROOT" && cargo build --release --quiet -p ongrid-images --example freeze_stdin)
    local freeze_bin="${CARGO_TARGET_DIR:-$ROOT/target}/release/examples/freeze_stdin"

    say "generating ~${DATA_MIB} MiB of mixed files in container $CONTAINER"
    docker run --name "$CONTAINER" "$IMAGE" python3 -c "$GENERATOR" "$DATA_MIB" >&2
    local export_bytes
    export_bytes="$(docker export "$CONTAINER" | wc -c)" # also warms the page cache
    say "export: $((export_bytes / 1024 / 1024)) MiB of tar"

    # tar2sqfs runs under GNU time through a wrapper first on PATH.
    mkdir -p "$WORK/bin" "$WORK/store"
    cat >"$WORK/bin/tar2sqfs" <<EOF
#!/bin/sh
exec /usr/bin/time -v -o "$WORK/tar2sqfs.time" "$(command -v tar2sqfs)" "\$@"
EOF
    chmod +x "$WORK/bin/tar2sqfs"

    local run ours_wall="" ref_wall="" ours_rss=0 tar2sqfs_rss=0 ours_size=0
    local ref_untar_rss=0 ref_mksquashfs_rss=0 ref_size=0
    for run in $(seq 1 "$RUNS"); do
        say "run $run/$RUNS, ours: docker export | freeze_stdin"
        local start wall report rss
        start="$(now)"
        report="$(docker export "$CONTAINER" | PATH="$WORK/bin:$PATH" "$freeze_bin" "$WORK/store" gzip)"
        wall="$(since "$start")"
        say "$wall s: $report"
        ours_wall="$(min "$ours_wall" "$wall")"
        rss="$(sed -n 's/.*peak RSS of this process \([0-9]*\) KiB.*/\1/p' <<<"$report")"
        ((rss > ours_rss)) && ours_rss="$rss"
        rss="$(peak_kib "$WORK/tar2sqfs.time")"
        ((rss > tar2sqfs_rss)) && tar2sqfs_rss="$rss"
        ours_size="$(find "$WORK/store/sha256" -name '*.sif' -printf '%s')"
        rm -rf "$WORK/store"

        say "run $run/$RUNS, reference: docker export > x.tar; tar -xf; mksquashfs -comp gzip -processors 2"
        mkdir "$WORK/r"
        start="$(now)"
        /usr/bin/time -v -o "$WORK/export.time" sh -c "docker export '$CONTAINER' > '$WORK/x.tar'"
        /usr/bin/time -v -o "$WORK/untar.time" tar -xf "$WORK/x.tar" -C "$WORK/r"
        /usr/bin/time -v -o "$WORK/mksquashfs.time" \
            mksquashfs "$WORK/r" "$WORK/out.sqfs" -comp gzip -noappend -processors 2 -quiet >/dev/null
        wall="$(since "$start")"
        say "$wall s"
        ref_wall="$(min "$ref_wall" "$wall")"
        rss="$(peak_kib "$WORK/untar.time")"
        ((rss > ref_untar_rss)) && ref_untar_rss="$rss"
        rss="$(peak_kib "$WORK/mksquashfs.time")"
        ((rss > ref_mksquashfs_rss)) && ref_mksquashfs_rss="$rss"
        ref_size="$(stat -c %s "$WORK/out.sqfs")"
        rm -rf "$WORK/r" "$WORK/x.tar" "$WORK/out.sqfs"
    done

    printf '\nbest of %d runs each (other load on the machine shows up as noise)\n' "$RUNS"
    printf '\n%-34s %10s %14s %12s\n' "" "wall (s)" "peak RSS (MiB)" "output (MiB)"
    printf '%-34s %10.2f %14s %12d\n' "ours (export|freeze, SIF)" "$ours_wall" \
        "$(((ours_rss + tar2sqfs_rss) / 1024))" "$((ours_size / 1024 / 1024))"
    printf '%-34s %10s %14s\n' "  freeze process" "" "$((ours_rss / 1024))"
    printf '%-34s %10s %14s\n' "  tar2sqfs" "" "$((tar2sqfs_rss / 1024))"
    printf '%-34s %10.2f %14s %12d\n' "reference (export, untar, mksquashfs)" "$ref_wall" \
        "$((ref_mksquashfs_rss / 1024))" "$((ref_size / 1024 / 1024))"
    printf '%-34s %10s %14s\n' "  tar -xf" "" "$((ref_untar_rss / 1024))"
    printf '%-34s %10s %14s\n' "  mksquashfs" "" "$((ref_mksquashfs_rss / 1024))"
    printf '\nratio ours / reference wall time: %.3f (target <= 0.70); ours peak memory %d MiB (target < 256)\n' \
        "$(awk -v a="$ours_wall" -v b="$ref_wall" 'BEGIN { print a / b }')" \
        "$(((ours_rss + tar2sqfs_rss) / 1024))"
}

main "$@"
