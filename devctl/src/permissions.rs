//! Files that only their owner may read: the private key, proxy or bearer token devctl presents
//! to the manager, and its config file, which says which key that is. Like ssh and the grid tools,
//! devctl refuses such a file while its group or others have any permission on it, and names
//! the `chmod` that fixes it. A file that cannot be inspected is left to the read that follows,
//! whose error says why.

use std::path::{Path, PathBuf};

/// A private file whose mode lets its group or others at it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} {} has mode {mode:04o}, open to its group or others, which devctl refuses as ssh does: run `chmod 600 {}`", path.display(), shell_word(path))]
pub struct TooOpen {
    /// What the file is to devctl: "private key file", "proxy file", "bearer token file",
    /// "config file".
    pub what: &'static str,
    pub path: PathBuf,
    /// The permission bits.
    pub mode: u32,
}

/// Refuses `path` when its group or others have any permission bit.
#[cfg(unix)]
pub fn check(path: &Path, what: &'static str) -> Result<(), TooOpen> {
    use std::os::unix::fs::PermissionsExt;
    let Ok(metadata) = std::fs::metadata(path) else {
        return Ok(());
    };
    let mode = metadata.permissions().mode() & 0o7777;
    if mode & 0o077 == 0 {
        return Ok(());
    }
    Err(TooOpen {
        what,
        path: path.to_path_buf(),
        mode,
    })
}

/// Other systems keep no such bits.
#[cfg(not(unix))]
pub fn check(_path: &Path, _what: &'static str) -> Result<(), TooOpen> {
    Ok(())
}

/// `path` as one shell word: as it is when it has no character a shell treats specially, else
/// in single quotes.
pub(crate) fn shell_word(path: &Path) -> String {
    let text = path.display().to_string();
    let plain = text
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "/._-+,:@%=".contains(c));
    if plain && !text.is_empty() {
        text
    } else {
        format!("'{}'", text.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
#[cfg(unix)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn with_mode(path: &Path, mode: u32) {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn only_owner_bits_pass() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x509up_u1000");
        std::fs::write(&path, "proxy").unwrap();
        for mode in [0o600, 0o400, 0o700] {
            with_mode(&path, mode);
            assert_eq!(check(&path, "proxy file"), Ok(()), "{mode:o}");
        }
        for mode in [0o644, 0o640, 0o604, 0o610, 0o601, 0o666] {
            with_mode(&path, mode);
            let err = check(&path, "proxy file").unwrap_err();
            assert_eq!(err.mode, mode);
            assert_eq!(
                err.to_string(),
                format!(
                    "proxy file {p} has mode {mode:04o}, open to its group or others, which \
                     devctl refuses as ssh does: run `chmod 600 {p}`",
                    p = path.display()
                )
            );
        }
        // A missing file is the read's to report.
        assert_eq!(check(&dir.path().join("missing"), "proxy file"), Ok(()));
    }

    #[test]
    fn the_chmod_names_the_file_as_one_shell_word() {
        assert_eq!(
            shell_word(Path::new("/tmp/x509up_u1000")),
            "/tmp/x509up_u1000"
        );
        assert_eq!(
            shell_word(Path::new("/home/a b/it's.pem")),
            r"'/home/a b/it'\''s.pem'"
        );
    }
}
