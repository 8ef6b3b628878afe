//! The image store on disk: `<store>/sha256/<hex>.sif` holds finished images (read-only,
//! named by the SHA-256 of the file, never rewritten); `<store>/.partial/` holds the work of
//! freezes in progress, removed when a freeze fails or is cancelled.

use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

pub const PARTIAL_DIR: &str = ".partial";
pub const IMAGES_DIR: &str = "sha256";

/// Where the image with SIF digest `hex` lives in `store`.
pub fn sif_path(store: &Path, hex: &str) -> PathBuf {
    store.join(IMAGES_DIR).join(format!("{hex}.sif"))
}

/// Whether an I/O error means the filesystem is full (or the quota is used up).
pub(crate) fn is_full(error: &io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(code) if code == nix::errno::Errno::ENOSPC as i32 || code == nix::errno::Errno::EDQUOT as i32
    )
}

/// Files under `.partial` that belong to one freeze: deleted on drop unless committed.
pub(crate) struct PartialFiles {
    paths: Vec<PathBuf>,
}

impl PartialFiles {
    pub fn new(paths: Vec<PathBuf>) -> Self {
        Self { paths }
    }

    /// Everything was moved or removed on purpose; nothing to clean up.
    pub fn commit(mut self) {
        self.paths.clear();
    }
}

impl Drop for PartialFiles {
    fn drop(&mut self) {
        for path in &self.paths {
            match fs::remove_file(path) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "Could not remove a partial image file.")
                }
            }
        }
    }
}

/// Moves the finished image `partial` to its content address `target` without ever replacing an
/// existing image: if `target` exists the existing file is kept. Returns whether it was new.
pub(crate) fn publish(partial: &Path, target: &Path) -> io::Result<bool> {
    fs::set_permissions(partial, fs::Permissions::from_mode(0o444))?;
    let created = match fs::hard_link(partial, target) {
        Ok(()) => true,
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => false,
        // Filesystems without hard links: rename, after checking, as the fallback.
        Err(e) if !is_full(&e) && !target.exists() => {
            fs::rename(partial, target)?;
            sync_dir(target)?;
            return Ok(true);
        }
        Err(e) => return Err(e),
    };
    fs::remove_file(partial)?;
    sync_dir(target)?;
    Ok(created)
}

/// fsync of the directory holding `path`, so a new name survives a crash.
fn sync_dir(path: &Path) -> io::Result<()> {
    match path.parent() {
        Some(dir) => fs::File::open(dir)?.sync_all(),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publish_makes_the_image_read_only_and_never_replaces_one() {
        let store = tempfile::tempdir().expect("tempdir");
        fs::create_dir_all(store.path().join(IMAGES_DIR)).expect("dir");
        let target = sif_path(store.path(), "abc");
        let first = store.path().join("first.sif");
        fs::write(&first, b"first").expect("write");
        assert!(publish(&first, &target).expect("publish"));
        assert!(!first.exists());
        let mode = fs::metadata(&target).expect("meta").permissions().mode();
        assert_eq!(mode & 0o777, 0o444);

        let second = store.path().join("second.sif");
        fs::write(&second, b"second").expect("write");
        assert!(!publish(&second, &target).expect("publish"));
        assert!(!second.exists());
        assert_eq!(fs::read(&target).expect("read"), b"first");
    }

    #[test]
    fn partial_files_go_unless_committed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = dir.path().join("a");
        fs::write(&a, b"x").expect("write");
        drop(PartialFiles::new(vec![
            a.clone(),
            dir.path().join("missing"),
        ]));
        assert!(!a.exists());
        fs::write(&a, b"x").expect("write");
        PartialFiles::new(vec![a.clone()]).commit();
        assert!(a.exists());
    }
}
