//! Freezing: turns the tar stream of `docker export` (a session container's filesystem) into an
//! immutable, content-addressed Apptainer SIF image in the image store.
//!
//! The pipeline streams and never unpacks the filesystem to disk:
//!
//! ```text
//! export tar ──▶ filter (this thread)             ──pipe──▶ tar2sqfs -j <cpus> ──▶ .partial/<id>.sqfs
//!                 drops STRIP_LIST, applies whiteouts,                                   │
//!                 appends /.singularity.d                                                ▼
//!        <store>/sha256/<hex>.sif (0444) ◀── rename ◀── .partial/<id>.sif: header, descriptors,
//!                                                        deffile, provenance JSON, squashfs
//! ```
//!
//! [`freeze`] is blocking; the agent runs it in `spawn_blocking`. Nothing here does network
//! I/O. [`sif`] also reads images back (tests, `devctl image show`).

mod apptainer;
mod filter;
mod provenance;
pub mod sif;
mod squashfs;
mod store;
mod strip;
mod tarout;

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use sha2::{Digest, Sha256};

pub use ongrid_core::image::Compression;
pub use provenance::{ImageConfig, Provenance, ProvenanceRecord, PROVENANCE_OBJECT};
pub use store::{sif_path, IMAGES_DIR, PARTIAL_DIR};
pub use strip::{pattern_matches, strip_rule_for, StripRule, STRIP_LIST};

use filter::{FilterError, FilterInput, FilterStats};
use squashfs::{PackError, Packer};
use store::{is_full, PartialFiles};
use tarout::TarWriter;

pub struct FreezeRequest<'a> {
    /// The tar stream of `docker export`.
    pub export: &'a mut dyn Read,
    pub config: ImageConfig,
    pub provenance: Provenance,
    pub compression: Compression,
    /// The image store directory.
    pub store: &'a Path,
    /// Expected bytes of tar (the container's filesystem size), 0 when unknown. Informational:
    /// it is logged and is what callers show as the progress total.
    pub estimated_size: u64,
    /// Called with the bytes of tar read so far, every few MiB and at the end.
    pub progress: &'a mut dyn FnMut(u64),
    /// Set to stop; checked between entries and between chunks of large files.
    pub cancel: &'a AtomicBool,
}

/// A finished image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frozen {
    /// `<store>/sha256/<hex>.sif`.
    pub sif_path: PathBuf,
    /// `sha256:<hex>` of the SIF file.
    pub digest: String,
    /// Bytes of the SIF file.
    pub size: u64,
    /// `sha256:<hex>` of the squashfs partition (also in the definition file and metadata).
    pub squashfs_digest: String,
}

#[derive(Debug, thiserror::Error)]
pub enum FreezeError {
    #[error("image store {} is full: free space or ask the admin", store.display())]
    StoreFull { store: PathBuf },
    #[error("the container's filesystem export is not a usable tar stream: {reason}")]
    BadTar { reason: String },
    #[error("reading the container's filesystem export failed: {source}: check the Docker daemon and retry")]
    Export {
        #[source]
        source: io::Error,
    },
    #[error("{tool} failed: {message}")]
    Tool { tool: &'static str, message: String },
    #[error("writing the copy of the filtered filesystem failed: {source}")]
    Copy {
        #[source]
        source: io::Error,
    },
    #[error("freeze cancelled")]
    Cancelled,
    #[error("image store {}: {source}: check that the directory exists and is writable", path.display())]
    Store {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Freezes the export stream into the image store. See the crate docs for the pipeline. On any
/// error or cancel, everything it wrote under `<store>/.partial` is removed.
pub fn freeze(req: FreezeRequest<'_>) -> Result<Frozen, FreezeError> {
    freeze_with_copy(req, None)
}

/// [`freeze`], also writing to `copy` the same filtered tar stream that goes into the squashfs
/// (what the strip list and whiteouts leave), without the generated `/.singularity.d` tree:
/// the filesystem of the matching Docker image. `copy` gets tar's end-of-archive marker only
/// when the whole export went through; a failure to write it fails the freeze
/// ([`FreezeError::Copy`]).
pub fn freeze_with_copy(
    req: FreezeRequest<'_>,
    copy: Option<&mut dyn Write>,
) -> Result<Frozen, FreezeError> {
    let FreezeRequest {
        export,
        config,
        provenance,
        compression,
        store,
        estimated_size,
        progress,
        cancel,
    } = req;
    let work = Work::create(store)?;
    tracing::info!(
        reference = %provenance.reference, session = %provenance.session, estimated_size,
        work = %work.id, "Freeze started."
    );
    // 1. export tar → filter → tar2sqfs → squashfs.
    let mtime = u64::try_from(provenance.created_at.timestamp()).unwrap_or(0);
    let generated = apptainer::singularity_tree(&config, &provenance);
    let filter = FilterInput {
        export,
        generated: &generated,
        mtime,
        cancel,
        progress,
    };
    let stats = pack(&work, filter, compression, copy, estimated_size)?;
    check_cancel(cancel)?;
    // 2. digest of the squashfs, then the SIF around it.
    let (squashfs_len, squashfs_hex) = squashfs_digest(&work, cancel)?;
    let record = ProvenanceRecord {
        format: "ongrid-provenance/1".to_string(),
        provenance: provenance.clone(),
        squashfs_digest: format!("sha256:{squashfs_hex}"),
        compression,
        config: config.clone(),
        freeze: freeze_summary(&stats),
        tool: format!("ongrid-images {}", env!("CARGO_PKG_VERSION")),
    };
    let layout = sif_layout(&record, squashfs_len)?;
    let sif_hex = wrap_in_sif(&work, &layout, cancel)?;
    check_cancel(cancel)?;
    // 3. publish under the content address.
    let (target, created) = work.publish(&sif_hex)?;
    tracing::info!(
        reference = %provenance.reference, digest = %sif_hex, size = layout.total_len, created,
        stripped = stats.stripped_entries, "Freeze done."
    );
    Ok(Frozen {
        sif_path: target,
        digest: format!("sha256:{sif_hex}"),
        size: layout.total_len,
        squashfs_digest: format!("sha256:{squashfs_hex}"),
    })
}

/// One freeze's files in `<store>/.partial`, removed unless the image is published.
struct Work<'a> {
    store: &'a Path,
    id: uuid::Uuid,
    partial_dir: PathBuf,
    squashfs: PathBuf,
    sif: PathBuf,
    cleanup: PartialFiles,
}

impl<'a> Work<'a> {
    /// Makes the store's directories and names this freeze's partial files.
    fn create(store: &'a Path) -> Result<Self, FreezeError> {
        let partial_dir = store.join(PARTIAL_DIR);
        let images_dir = store.join(IMAGES_DIR);
        for dir in [&partial_dir, &images_dir] {
            fs::create_dir_all(dir).map_err(|e| store_error(store, dir, e))?;
        }
        let id = uuid::Uuid::new_v4();
        let squashfs = partial_dir.join(format!("{id}.sqfs"));
        let sif = partial_dir.join(format!("{id}.sif"));
        Ok(Self {
            store,
            id,
            cleanup: PartialFiles::new(vec![squashfs.clone(), sif.clone()]),
            partial_dir,
            squashfs,
            sif,
        })
    }

    fn error(&self, path: &Path, source: io::Error) -> FreezeError {
        store_error(self.store, path, source)
    }

    /// Moves the finished SIF to `<store>/sha256/<hex>.sif`; returns that path, and whether
    /// the file is new (an image of the same digest is kept as it is).
    fn publish(self, sif_hex: &str) -> Result<(PathBuf, bool), FreezeError> {
        let target = store::sif_path(self.store, sif_hex);
        let created = store::publish(&self.sif, &target).map_err(|e| self.error(&target, e))?;
        self.cleanup.commit();
        Ok((target, created))
    }
}

/// A failed write to the store: full, or another problem with `path`.
fn store_error(store: &Path, path: &Path, source: io::Error) -> FreezeError {
    if is_full(&source) {
        FreezeError::StoreFull {
            store: store.to_path_buf(),
        }
    } else {
        FreezeError::Store {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Filters the export into `tar2sqfs` (and `copy`) and waits for the squashfs.
fn pack(
    work: &Work<'_>,
    filter: FilterInput<'_>,
    compression: Compression,
    copy: Option<&mut dyn Write>,
    estimated_size: u64,
) -> Result<FilterStats, FreezeError> {
    let packing_error = |e| pack_error(e, work.store, &work.partial_dir, estimated_size);
    let jobs = std::thread::available_parallelism().map_or(2, |n| n.get());
    let (packer, pipe) =
        Packer::spawn(&work.squashfs, compression, jobs, filter.mtime).map_err(packing_error)?;
    let filtered = filter::filter_export(
        filter,
        TarWriter::new(filter::Tee {
            main: io::BufWriter::with_capacity(1024 * 1024, pipe),
            copy,
        }),
    );
    match filtered {
        Ok(stats) => {
            packer.wait().map_err(packing_error)?;
            Ok(stats)
        }
        // The pipe broke: tar2sqfs stopped, and its message says why.
        Err(FilterError::Write(write_error)) => Err(match packer.wait() {
            Err(e) => packing_error(e),
            Ok(()) => stopped_reading(&write_error),
        }),
        Err(other) => {
            drop(packer); // kills tar2sqfs before its output is removed
            Err(filter_failure(other))
        }
    }
}

/// What a failure of the filter itself (not of `tar2sqfs`) means for the freeze.
fn filter_failure(error: FilterError) -> FreezeError {
    match error {
        FilterError::Cancelled => FreezeError::Cancelled,
        FilterError::BadTar(reason) => FreezeError::BadTar { reason },
        FilterError::Read(source) => FreezeError::Export { source },
        FilterError::Copy(source) => FreezeError::Copy { source },
        FilterError::Write(source) => stopped_reading(&source),
    }
}

fn stopped_reading(write_error: &io::Error) -> FreezeError {
    FreezeError::Tool {
        tool: squashfs::TOOL,
        message: format!("it stopped reading its input: {write_error}"),
    }
}

/// The squashfs's length and sha256 (hex).
fn squashfs_digest(work: &Work<'_>, cancel: &AtomicBool) -> Result<(u64, String), FreezeError> {
    let len = fs::metadata(&work.squashfs)
        .map_err(|e| work.error(&work.squashfs, e))?
        .len();
    let hex = sha256_file(&work.squashfs, cancel).map_err(|e| match e {
        CopyError::Cancelled => FreezeError::Cancelled,
        CopyError::Io(e) => work.error(&work.squashfs, e),
    })?;
    Ok((len, hex))
}

/// The SIF's layout: the definition file and the provenance record inline, then the squashfs
/// of `squashfs_len` bytes as the primary partition.
fn sif_layout(record: &ProvenanceRecord, squashfs_len: u64) -> Result<sif::Layout, FreezeError> {
    let own_error = |message: String| FreezeError::Tool {
        tool: "ongrid-images",
        message,
    };
    let mut json = serde_json::to_vec_pretty(record)
        .map_err(|e| own_error(format!("provenance record: {e}")))?;
    json.push(b'\n');
    let squashfs_hex = record.squashfs_digest.trim_start_matches("sha256:");
    let deffile = definition_file(&record.provenance, &record.config, squashfs_hex);
    sif::Layout::new(
        &[
            sif::InlineObject {
                data_type: sif::DataType::Deffile,
                name: String::new(),
                data: deffile.into_bytes(),
            },
            sif::InlineObject {
                data_type: sif::DataType::GenericJson,
                name: PROVENANCE_OBJECT.to_string(),
                data: json,
            },
        ],
        sif::PartitionInfo {
            fs_type: sif::FsType::Squashfs,
            part_type: sif::PartType::PrimarySystem,
            arch: sif::ARCH_AMD64,
        },
        squashfs_len,
        uuid::Uuid::new_v4(),
        record.provenance.created_at.timestamp(),
    )
    .map_err(|e| own_error(e.to_string()))
}

/// Writes the partial SIF around the squashfs, then removes the squashfs (it is inside the SIF
/// now: its space is freed before publishing). Returns the SIF's sha256 (hex).
fn wrap_in_sif(
    work: &Work<'_>,
    layout: &sif::Layout,
    cancel: &AtomicBool,
) -> Result<String, FreezeError> {
    let sif_hex = write_sif(&work.sif, layout, &work.squashfs, cancel).map_err(|e| match e {
        CopyError::Cancelled => FreezeError::Cancelled,
        CopyError::Io(e) => work.error(&work.sif, e),
    })?;
    fs::remove_file(&work.squashfs).map_err(|e| work.error(&work.squashfs, e))?;
    Ok(sif_hex)
}

fn check_cancel(cancel: &AtomicBool) -> Result<(), FreezeError> {
    if cancel.load(Ordering::Relaxed) {
        Err(FreezeError::Cancelled)
    } else {
        Ok(())
    }
}

/// tar2sqfs reports a failed write as "I/O error" without the cause, and removes its output
/// before it exits, so the space it filled is free again when this looks. A failure while the
/// store's filesystem has (next to) no space left, or an I/O error while it has less free space
/// than the image's estimated (uncompressed) size, is taken as the store being full.
fn pack_error(
    error: PackError,
    store: &Path,
    partial_dir: &Path,
    estimated_size: u64,
) -> FreezeError {
    const NEARLY_FULL: u64 = 4 * 1024 * 1024;
    let short_of = |needed: u64| {
        nix::sys::statvfs::statvfs(partial_dir)
            .is_ok_and(|fs| fs.blocks_available().saturating_mul(fs.fragment_size()) < needed)
    };
    match error {
        PackError::Missing => FreezeError::Tool {
            tool: squashfs::TOOL,
            message: "not found: install squashfs-tools-ng (apt-get install squashfs-tools-ng)"
                .to_string(),
        },
        PackError::Io(e) => FreezeError::Tool {
            tool: squashfs::TOOL,
            message: e.to_string(),
        },
        PackError::Failed { stderr, .. }
            if stderr.contains("No space left on device")
                || short_of(NEARLY_FULL)
                || (stderr.contains("I/O error") && short_of(estimated_size)) =>
        {
            FreezeError::StoreFull {
                store: store.to_path_buf(),
            }
        }
        PackError::Failed { status, stderr } => FreezeError::Tool {
            tool: squashfs::TOOL,
            message: format!("{status}: {stderr}"),
        },
    }
}

/// The definition-file object: how the image was made, for `apptainer inspect --deffile`.
fn definition_file(provenance: &Provenance, config: &ImageConfig, squashfs_hex: &str) -> String {
    let one_line = |s: &str| s.replace(['\n', '\r'], " ");
    let mut text = format!(
        "# Frozen by ongrid from an interactive session: the image holds the session's files,\n\
         # it cannot be rebuilt from this file alone.\n\
         # owner: {owner}\n\
         # session: {session}\n\
         # reference: {reference}\n\
         # base image: {base}\n\
         # created: {created}\n\
         # squashfs sha256: {squashfs_hex}\n\
         bootstrap: docker-daemon\n\
         from: {base}\n\n\
         %labels\n    \
         org.ongrid.owner {owner}\n    \
         org.ongrid.session {session}\n    \
         org.ongrid.reference {reference}\n    \
         org.ongrid.base-image {base}\n    \
         org.ongrid.created {created}\n    \
         org.ongrid.squashfs-sha256 {squashfs_hex}\n",
        owner = one_line(&provenance.owner),
        session = one_line(&provenance.session),
        reference = one_line(&provenance.reference),
        base = one_line(&provenance.base_image),
        created = provenance.created_at.to_rfc3339(),
    );
    if !config.env.is_empty() {
        text.push_str("\n%environment\n");
        for entry in &config.env {
            text.push_str(&format!("    # {}\n", one_line(entry)));
        }
    }
    text
}

fn freeze_summary(stats: &FilterStats) -> serde_json::Value {
    serde_json::json!({
        "entries_read": stats.entries_read,
        "entries_written": stats.entries_written,
        "tar_bytes_read": stats.bytes_read,
        "stripped_entries": stats.stripped_entries,
        "stripped_bytes": stats.stripped_bytes,
        "stripped_by": stats.stripped_by,
        "whiteouts": stats.whiteouts,
        "dropped_hard_links": stats.dropped_hard_links,
        "dropped_hard_links_total": stats.dropped_hard_links_total,
        "dropped_xattrs": stats.dropped_xattrs,
        "added_dirs": stats.added_dirs,
    })
}

enum CopyError {
    Cancelled,
    Io(io::Error),
}

impl From<io::Error> for CopyError {
    fn from(e: io::Error) -> Self {
        Self::Io(e)
    }
}

const CHUNK: usize = 1024 * 1024;

fn sha256_file(path: &Path, cancel: &AtomicBool) -> Result<String, CopyError> {
    let mut file = File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; CHUNK];
    loop {
        if cancel.load(Ordering::Relaxed) {
            return Err(CopyError::Cancelled);
        }
        let n = read_some(&mut file, &mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

/// Writes the SIF (`layout.prefix`, then the squashfs), fsyncs it and returns its sha256.
fn write_sif(
    path: &Path,
    layout: &sif::Layout,
    squashfs: &Path,
    cancel: &AtomicBool,
) -> Result<String, CopyError> {
    let mut out = File::create_new(path)?;
    let mut hasher = Sha256::new();
    out.write_all(&layout.prefix)?;
    hasher.update(&layout.prefix);
    let mut input = File::open(squashfs)?;
    let mut buf = vec![0u8; CHUNK];
    let mut copied = 0u64;
    loop {
        if cancel.load(Ordering::Relaxed) {
            return Err(CopyError::Cancelled);
        }
        let n = read_some(&mut input, &mut buf)?;
        if n == 0 {
            break;
        }
        out.write_all(&buf[..n])?;
        hasher.update(&buf[..n]);
        copied += n as u64;
    }
    if layout.partition_offset + copied != layout.total_len {
        return Err(CopyError::Io(io::Error::other(format!(
            "squashfs changed size while it was copied ({copied} bytes)"
        ))));
    }
    out.sync_all()?;
    Ok(hex::encode(hasher.finalize()))
}

fn read_some(file: &mut File, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        match file.read(buf) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            other => return other,
        }
    }
}
