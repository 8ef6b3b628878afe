//! What a container's home and site mounts need on the node's filesystem before it is made
//! ([`crate::storage`] decides which they are): a home on site storage made for its user, and
//! the sources of the bind mounts checked to exist. Blocking; the Docker runtime calls them.

use std::io;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use ongrid_core::api::ContainerUser;

use super::BindMount;

/// Why a home on site storage could not be made.
#[derive(Debug, thiserror::Error)]
pub enum HomeError {
    #[error("{root} does not exist on this node: the site's home storage is not mounted ([storage] home)")]
    RootMissing { root: PathBuf },
    #[error("{path} exists but is not a directory: move it away or fix [storage] home")]
    NotADirectory { path: PathBuf },
    #[error("cannot make the home {path}")]
    Create {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot give the home {path} to uid {uid} (create it yourself: mkdir {path}; chown {uid}:{uid} {path}; chmod {mode:o} {path})")]
    Chown {
        path: PathBuf,
        uid: u32,
        mode: u32,
        #[source]
        source: io::Error,
    },
}

/// Makes the home `path` for `uid` (group `uid`, like the container's user) when it does not
/// exist: in a new directory beside it, given to the user with `mode`, then renamed into place,
/// so an agent on another node making the same home at once never sees it half-made. `root`
/// must exist; the directories between it and `path` are made root-owned, mode 0755. An
/// existing home is left as it is. Returns whether it made it. Blocking.
pub fn ensure_home_directory(
    path: &Path,
    root: &Path,
    uid: u32,
    mode: u32,
) -> Result<bool, HomeError> {
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_dir() => return Ok(false),
        Ok(_) => {
            return Err(HomeError::NotADirectory {
                path: path.to_owned(),
            })
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(HomeError::Create {
                path: path.to_owned(),
                source,
            })
        }
    }
    if !root.is_dir() {
        return Err(HomeError::RootMissing {
            root: root.to_owned(),
        });
    }
    let create = |source| HomeError::Create {
        path: path.to_owned(),
        source,
    };
    let parent = path
        .parent()
        .ok_or_else(|| create(io::Error::other("a home cannot be /")))?;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(parent)
        .map_err(create)?;
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let fresh = parent.join(format!(
        ".ongrid-new-{name}-{}",
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&fresh)
        .map_err(create)?;
    let made = std::os::unix::fs::chown(&fresh, Some(uid), Some(uid))
        .map_err(|source| HomeError::Chown {
            path: path.to_owned(),
            uid,
            mode,
            source,
        })
        .and_then(|()| {
            std::fs::set_permissions(&fresh, std::fs::Permissions::from_mode(mode)).map_err(create)
        })
        .and_then(|()| match std::fs::rename(&fresh, path) {
            Ok(()) => Ok(true),
            // Another node made it meanwhile and its user already wrote there.
            Err(_) if path.is_dir() => Ok(false),
            Err(e) => Err(create(e)),
        });
    if !matches!(made, Ok(true)) {
        let _ = std::fs::remove_dir(&fresh);
    }
    made
}

/// Checks that the sources of `binds` exist (a read-write entry with `{login}` names a
/// directory per user, which the site makes): the problem, for a person, when one does not.
pub fn missing_source(binds: &[BindMount], user: &ContainerUser) -> Option<String> {
    binds.iter().find(|b| !b.source.exists()).map(|bind| {
        format!(
            "site storage {} does not exist on this node: make it for user {} (uid {}), or fix [storage] in the agent's config",
            bind.source.display(),
            user.name,
            user.uid
        )
    })
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    #[test]
    fn a_home_is_made_once_for_its_user() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("home");
        std::fs::create_dir(&root).unwrap();
        let path = root.join("projects/alice-smith");
        assert!(ensure_home_directory(&path, &root, 20001, 0o750).unwrap());
        let meta = std::fs::metadata(&path).unwrap();
        assert!(meta.is_dir());
        assert_eq!((meta.uid(), meta.gid()), (20001, 20001));
        assert_eq!(meta.mode() & 0o7777, 0o750);
        let between = std::fs::metadata(root.join("projects")).unwrap();
        assert_eq!(between.mode() & 0o777, 0o755);
        // Nothing left beside it, and a second call keeps what the user wrote.
        std::fs::write(path.join("notes.txt"), "mine").unwrap();
        assert!(!ensure_home_directory(&path, &root, 20001, 0o750).unwrap());
        assert_eq!(
            std::fs::read_to_string(path.join("notes.txt")).unwrap(),
            "mine"
        );
        let names: Vec<_> = std::fs::read_dir(root.join("projects"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["alice-smith"]);
    }

    #[test]
    fn a_home_is_never_made_on_unmounted_storage() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("not-mounted");
        let err = ensure_home_directory(&root.join("alice"), &root, 20001, 0o700).unwrap_err();
        assert!(matches!(err, HomeError::RootMissing { .. }), "{err}");
        assert!(!root.exists());
        std::fs::write(dir.path().join("file"), "").unwrap();
        let err =
            ensure_home_directory(&dir.path().join("file"), dir.path(), 1, 0o700).unwrap_err();
        assert!(matches!(err, HomeError::NotADirectory { .. }), "{err}");
    }
}
