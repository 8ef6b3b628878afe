//! The SIF files of frozen images in the manager's `image_store` (`<store>/sha256/<hex>.sif`):
//! deleted when the last image with their digest is removed (`devctl image rm`, or with its
//! user, `devctl admin user rm`).

use std::path::Path;

use ongrid_core::image::parse_digest;

/// Deletes `<store>/sha256/<hex>.sif`; a file already gone is fine, any other failure is logged
/// for the admin (the image is DELETED either way).
pub fn remove_sif(store: &Path, digest: &str) {
    let Ok(hex) = parse_digest(digest) else {
        tracing::error!(%digest, "A stored image digest is malformed; its SIF file is left.");
        return;
    };
    let path = store.join("sha256").join(format!("{hex}.sif"));
    match std::fs::remove_file(&path) {
        Ok(()) => tracing::info!(path = %path.display(), "SIF file deleted."),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::error!(path = %path.display(), error = %e, "Cannot delete a SIF file of a removed image; delete it by hand.")
        }
    }
}
