#!/usr/bin/env bash
# Runs the fuzz targets of fuzz/ (cargo-fuzz, libFuzzer) for a bounded time each, starting from
# the seeds checked in under fuzz/seeds/<target>/ (copied to a scratch corpus, so a run leaves
# the checkout as it was). A crash, a panic or an input slower than 10 s fails the run; libFuzzer
# leaves the input in fuzz/artifacts/<target>/. Reproduce one with
#   RUSTC_BOOTSTRAP=1 cargo fuzz run -s none --target-dir ../target/fuzz <target> <input>
#
# Usage: fuzz/run.sh [SECONDS [TARGET...]]   (per target; default 30 s, every target)
#        fuzz/run.sh --build-only              (builds the targets, runs none)
# The build goes to target/fuzz/, or to $ONGRID_FUZZ_TARGET_DIR when set.
# Needs: cargo-fuzz (cargo install cargo-fuzz --locked). The stable toolchain is used with
# RUSTC_BOOTSTRAP=1 (cargo-fuzz passes nightly-only -Z flags to rustc). No AddressSanitizer
# (-s none): the crates fuzzed forbid unsafe code, and ASan would double the build and slow
# every execution; libFuzzer's coverage, panics and debug assertions are kept.
set -euo pipefail

FUZZ_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly FUZZ_DIR
readonly REPO_ROOT="$FUZZ_DIR/.."
readonly TARGET_DIR="${ONGRID_FUZZ_TARGET_DIR:-$REPO_ROOT/target/fuzz}"
readonly ALL_TARGETS=(ssh_route config api_bodies proxy_v2 bearer_token)

die() {
    printf 'fuzz/run.sh: error: %s\n' "$*" >&2
    exit 1
}

command -v cargo-fuzz >/dev/null || die "cargo-fuzz not found: cargo install cargo-fuzz --locked"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

main() {
    cd "$FUZZ_DIR"
    export RUSTC_BOOTSTRAP=1
    printf '==> building the fuzz targets\n'
    cargo fuzz build -s none --target-dir "$TARGET_DIR" ||
        die "building the fuzz targets failed"
    [[ "${1:-}" != --build-only ]] || return 0
    local seconds_per_target=${1:-30}
    shift || true
    local targets=("${ALL_TARGETS[@]}")
    (($# == 0)) || targets=("$@")
    # The config target's fixture directory goes to the scratch directory too.
    export TMPDIR="$work"
    local fuzz=(cargo fuzz run -s none --target-dir "$TARGET_DIR")
    local target
    for target in "${targets[@]}"; do
        [[ -d "seeds/$target" ]] || die "no seeds/$target: the targets are ${ALL_TARGETS[*]}"
        printf '==> fuzzing %s for %ss\n' "$target" "$seconds_per_target"
        mkdir -p "$work/corpus/$target"
        cp "seeds/$target"/* "$work/corpus/$target/"
        local log="$work/$target.log" status=0
        "${fuzz[@]}" "$target" "$work/corpus/$target" -- \
            -max_total_time="$seconds_per_target" -timeout=10 -print_final_stats=1 \
            >"$log" 2>&1 || status=$?
        grep -E '^(INFO: seed|#[0-9]+ +DONE|stat::number_of_executed_units|stat::peak_rss_mb)' "$log" || true
        if ((status != 0)); then
            tail -40 "$log" >&2
            die "fuzz target $target failed (input saved under $FUZZ_DIR/artifacts/$target/)"
        fi
    done
}

main "$@"
