//! A job's Docker image, built from its SIF when the node's Docker lacks it.
//!
//! The SIF in the image store is the source of truth (`<store>/sha256/<hex>.sif`). Building,
//! once per digest at a time:
//!
//! ```text
//! SIF ─ SifImage::read ─▶ primary squashfs partition ─copy─▶ <work>/build-<hex>.sqfs
//!     └─ ongrid-provenance.json: env, working dir, entrypoint, cmd   │
//!                                                                    ▼
//!               docker import --change ENV/WORKDIR/ENTRYPOINT/CMD ◀── sqfs2tar (tar stream)
//! ```
//!
//! The configuration comes from the provenance record every frozen image carries
//! (`ongrid_images::ProvenanceRecord::config`, the session image's own `Config`): unlike the
//! `/.singularity.d` scripts, it is data, needs no shell to interpret, and is what the freeze
//! tagged the matching Docker image with. A SIF without one (not made by ongrid) gets Docker's
//! defaults. `sqfs2tar` needs a file it can seek in, hence the copy of the partition; it is
//! removed when the import ends either way.

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex, MutexGuard};

use futures::{StreamExt, TryStreamExt};
use ongrid_core::job::JobImage;
use ongrid_images::sif::{DataType, SifImage};
use ongrid_images::{ProvenanceRecord, PROVENANCE_OBJECT};
use tokio::io::AsyncReadExt;
use tracing::{info, warn};

use crate::runtime::{error_chain, ContainerRuntime, ImportConfig};

/// Where the builds of this node stand, by digest. A finished build leaves no entry (the
/// image is then on the node); a failed one stays until no desired job names its digest.
#[derive(Debug, Clone, Default)]
pub struct Builds {
    state: Arc<Mutex<HashMap<String, BuildState>>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BuildState {
    Building { detail: String },
    Failed { error: String },
}

/// What a build needs besides the image.
#[derive(Debug, Clone)]
pub struct BuildPlace {
    /// The image store: `<store>/sha256/<hex>.sif`.
    pub store: PathBuf,
    /// A node-local directory for the squashfs copy.
    pub work: PathBuf,
}

impl Builds {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, BuildState>> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn get(&self, digest: &str) -> Option<BuildState> {
        self.lock().get(digest).cloned()
    }

    /// Starts building `image` unless a build of its digest runs or failed.
    pub fn ensure(
        &self,
        runtime: Arc<dyn ContainerRuntime>,
        place: BuildPlace,
        image: &JobImage,
        tasks: &tokio_util::task::TaskTracker,
    ) {
        {
            let mut state = self.lock();
            if state.contains_key(&image.digest) {
                return;
            }
            state.insert(
                image.digest.clone(),
                BuildState::Building {
                    detail: format!("building image {} from its SIF", image.docker_image),
                },
            );
        }
        let builds = self.clone();
        let image = image.clone();
        tasks.spawn(async move {
            let result = build(&*runtime, &place, &image, &builds).await;
            let mut state = builds.lock();
            match result {
                Ok(()) => {
                    info!(digest = %image.digest, image = %image.docker_image, "Built a job's image from its SIF.");
                    state.remove(&image.digest);
                }
                Err(error) => {
                    warn!(digest = %image.digest, %error, "Cannot build a job's image from its SIF.");
                    state.insert(image.digest.clone(), BuildState::Failed { error });
                }
            }
        });
    }

    /// Forgets the failures of digests no desired job names (a later job may try again).
    pub fn retain(&self, digests: &[&str]) {
        self.lock().retain(|digest, state| {
            matches!(state, BuildState::Building { .. }) || digests.contains(&digest.as_str())
        });
    }

    fn set_detail(&self, digest: &str, detail: String) {
        if let Some(BuildState::Building { detail: d }) = self.lock().get_mut(digest) {
            *d = detail;
        }
    }
}

/// The SIF's hex digest, checked.
fn sif_hex(digest: &str) -> Result<&str, String> {
    digest
        .strip_prefix("sha256:")
        .filter(|hex| hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
        .ok_or_else(|| format!("image digest {digest:?} is not sha256:<64 hex digits>"))
}

async fn build(
    runtime: &dyn ContainerRuntime,
    place: &BuildPlace,
    image: &JobImage,
    builds: &Builds,
) -> Result<(), String> {
    let hex = sif_hex(&image.digest)?.to_owned();
    let sif = ongrid_images::sif_path(&place.store, &hex);
    std::fs::create_dir_all(&place.work)
        .map_err(|e| format!("creating {}: {e}", place.work.display()))?;
    let squashfs = place.work.join(format!("build-{hex}.sqfs"));
    let copy = {
        let (sif, squashfs) = (sif.clone(), squashfs.clone());
        tokio::task::spawn_blocking(move || extract(&sif, &squashfs))
    };
    let result = match copy.await {
        Ok(Ok((config, size))) => import(runtime, image, &squashfs, &config, size, builds).await,
        Ok(Err(error)) => Err(error),
        Err(e) => Err(format!("reading {}: {e}", sif.display())),
    };
    let _ = std::fs::remove_file(&squashfs);
    result
}

/// Copies the SIF's squashfs partition to `squashfs`; returns the frozen image's configuration
/// and the partition's size.
fn extract(sif: &Path, squashfs: &Path) -> Result<(ImportConfig, u64), String> {
    let broken = |problem: String| {
        format!(
            "SIF image {} is broken ({problem}): freeze the session again, or ask the admin to restore the file",
            sif.display()
        )
    };
    let mut file = std::fs::File::open(sif).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            format!(
                "SIF image {} is not in the image store: check that this node's [images] store is the manager's image store",
                sif.display()
            )
        } else {
            format!("cannot open SIF image {}: {e}", sif.display())
        }
    })?;
    let image = SifImage::read(&mut file).map_err(|e| broken(error_chain(&e)))?;
    let partition = image
        .primary_partition()
        .ok_or_else(|| broken("it has no primary partition".into()))?
        .clone();
    let config = match image.find(DataType::GenericJson, Some(PROVENANCE_OBJECT)) {
        Some(object) => {
            let json = image
                .object_data(&mut file, object)
                .map_err(|e| broken(error_chain(&e)))?;
            let record: ProvenanceRecord = serde_json::from_slice(&json)
                .map_err(|e| broken(format!("{PROVENANCE_OBJECT}: {e}")))?;
            ImportConfig::from(record.config)
        }
        None => {
            warn!(sif = %sif.display(), "The SIF has no ongrid provenance; its image gets Docker's defaults.");
            ImportConfig::default()
        }
    };
    let size = partition.size as u64;
    file.seek(SeekFrom::Start(partition.offset as u64))
        .map_err(|e| broken(e.to_string()))?;
    let mut out = std::fs::File::create(squashfs)
        .map_err(|e| format!("creating {}: {e}", squashfs.display()))?;
    let copied = std::io::copy(&mut (&mut file).take(size), &mut out).map_err(|e| {
        format!(
            "copying the squashfs of {} to {}: {e}",
            sif.display(),
            squashfs.display()
        )
    })?;
    if copied != size {
        return Err(broken(format!(
            "its partition is cut short at {copied} of {size} bytes"
        )));
    }
    Ok((config, size))
}

/// `sqfs2tar` of the copied partition into `docker import`.
async fn import(
    runtime: &dyn ContainerRuntime,
    image: &JobImage,
    squashfs: &Path,
    config: &ImportConfig,
    size: u64,
    builds: &Builds,
) -> Result<(), String> {
    let mut child = tokio::process::Command::new("sqfs2tar")
        .arg(squashfs)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| {
            format!("cannot run sqfs2tar (squashfs-tools-ng): {e}: install it on the node")
        })?;
    let (Some(stdout), Some(mut stderr)) = (child.stdout.take(), child.stderr.take()) else {
        return Err("sqfs2tar has no pipes".into());
    };
    // Warnings (skipped files) must not fill the pipe and stall the tar stream.
    let stderr_task = tokio::spawn(async move {
        let mut text = Vec::new();
        let _ = (&mut stderr).take(64 * 1024).read_to_end(&mut text).await;
        let _ = tokio::io::copy(&mut stderr, &mut tokio::io::sink()).await;
        String::from_utf8_lossy(&text).trim().to_owned()
    });
    let mut sent = 0u64;
    let progress = builds.clone();
    let digest = image.digest.clone();
    let reference = image.docker_image.clone();
    let mib = |bytes: u64| bytes / (1024 * 1024);
    let tar = tokio_util::io::ReaderStream::new(stdout)
        .map_ok(move |chunk| {
            let before = mib(sent);
            sent += chunk.len() as u64;
            if mib(sent) != before {
                progress.set_detail(
                    &digest,
                    format!(
                        "building image {reference} from its SIF: {} MiB of tar from {} MiB of squashfs",
                        mib(sent),
                        mib(size)
                    ),
                );
            }
            chunk.to_vec()
        })
        .boxed();
    let imported = runtime
        .import_image(&image.docker_image, config, tar)
        .await
        .map_err(|e| {
            format!(
                "importing image {}: {}",
                image.docker_image,
                error_chain(&e)
            )
        });
    let status = child
        .wait()
        .await
        .map_err(|e| format!("waiting for sqfs2tar: {e}"))?;
    let warnings = stderr_task.await.unwrap_or_default();
    if !status.success() {
        // The import may have made an image of a partial tar: remove it.
        let _ = runtime.untag_image(&image.docker_image).await;
        return Err(format!("sqfs2tar failed ({status}): {warnings}"));
    }
    imported
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_are_checked() {
        assert_eq!(
            sif_hex(&format!("sha256:{}", "ab".repeat(32))).unwrap(),
            "ab".repeat(32)
        );
        assert!(sif_hex("sha256:abc").is_err());
        assert!(sif_hex(&format!("md5:{}", "ab".repeat(32))).is_err());
        assert!(sif_hex(&format!("sha256:{}", "zz".repeat(32))).is_err());
    }
}
