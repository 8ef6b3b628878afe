//! Freezes a tar stream read on stdin (e.g. `docker export C | freeze_stdin STORE`) into the
//! image store STORE and prints the result. Used by `images/benches/freeze.sh`.
//!
//! Usage: freeze_stdin STORE [gzip|zstd]

use std::sync::atomic::AtomicBool;
use std::time::Instant;

use anyhow::Context;
use ongrid_images::{freeze, Compression, FreezeRequest, ImageConfig, Provenance};

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let store = args
        .next()
        .context("usage: freeze_stdin STORE [gzip|zstd]")?;
    let compression = match args.next().as_deref() {
        None | Some("gzip") => Compression::Gzip,
        Some("zstd") => Compression::Zstd,
        Some(other) => anyhow::bail!("unknown compression {other}: use gzip or zstd"),
    };
    let started = Instant::now();
    let stdin = std::io::stdin();
    let mut export = stdin.lock();
    let mut last = 0u64;
    let mut progress = |bytes: u64| last = bytes;
    let cancel = AtomicBool::new(false);
    let frozen = freeze(FreezeRequest {
        export: &mut export,
        config: ImageConfig {
            env: vec!["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into()],
            working_dir: None,
            entrypoint: vec![],
            cmd: vec!["/bin/bash".into()],
            user: None,
        },
        provenance: Provenance {
            owner: "/DC=org/DC=example/CN=Bench".into(),
            session: "bench".into(),
            base_image: "ongrid/dev:latest".into(),
            reference: "bench:v1".into(),
            created_at: chrono::Utc::now(),
        },
        compression,
        store: std::path::Path::new(&store),
        estimated_size: 0,
        progress: &mut progress,
        cancel: &cancel,
    })?;
    println!(
        "{} {} bytes (tar read {} bytes) in {:.2}s, peak RSS of this process {} KiB",
        frozen.sif_path.display(),
        frozen.size,
        last,
        started.elapsed().as_secs_f64(),
        peak_rss_kib().unwrap_or(0)
    );
    Ok(())
}

/// VmHWM of this process (its own peak resident set, children not included).
fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}
