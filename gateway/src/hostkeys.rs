//! The gateway's SSH host keys: an Ed25519 key and an RSA key (for older clients), kept in
//! `host_key_dir` in OpenSSH's format as `ssh_host_ed25519_key` and `ssh_host_rsa_key` (0600,
//! with `.pub` files beside them). They are created on first start and loaded after, so clients'
//! `known_hosts` entries stay valid across restarts.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use russh::keys::ssh_key::private::RsaKeypair;
use russh::keys::ssh_key::LineEnding;
use russh::keys::{Algorithm, HashAlg, PrivateKey};

/// The Ed25519 host key's file name, as OpenSSH names it.
pub const ED25519_FILE: &str = "ssh_host_ed25519_key";
/// The RSA host key's file name, as OpenSSH names it.
pub const RSA_FILE: &str = "ssh_host_rsa_key";
/// The size of a generated RSA host key.
pub const RSA_BITS: usize = 3072;

#[derive(Debug, thiserror::Error)]
pub enum HostKeyError {
    #[error("cannot create host_key_dir {path}")]
    CreateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read host key {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "host key {path} is not an OpenSSH private key: remove it to have a new one generated"
    )]
    Parse {
        path: PathBuf,
        #[source]
        source: russh::keys::ssh_key::Error,
    },
    #[error("host key {path} is encrypted: the gateway needs it without a passphrase")]
    Encrypted { path: PathBuf },
    #[error("host key {path} has mode {mode:o}, readable by others: run chmod 600 on it")]
    Unprotected { path: PathBuf, mode: u32 },
    #[error("generating the {algorithm} host key")]
    Generate {
        algorithm: &'static str,
        #[source]
        source: russh::keys::ssh_key::Error,
    },
    #[error("cannot write host key {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The keys to offer, Ed25519 first. Missing ones are generated and written (0600) first.
/// Generating the RSA key takes a moment: call this from a blocking context.
pub fn load_or_create(dir: &Path) -> Result<Vec<PrivateKey>, HostKeyError> {
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|source| HostKeyError::CreateDir {
                path: dir.to_owned(),
                source,
            })?;
    }
    let mut keys = Vec::with_capacity(2);
    for (file, kind) in [(ED25519_FILE, KeyKind::Ed25519), (RSA_FILE, KeyKind::Rsa)] {
        let path = dir.join(file);
        let key = if path.exists() {
            load(&path)?
        } else {
            let key = kind.generate()?;
            write(&path, &key)?;
            tracing::info!(
                path = %path.display(),
                fingerprint = %key.fingerprint(HashAlg::Sha256),
                "Host key generated."
            );
            key
        };
        tracing::info!(
            algorithm = %key.algorithm(),
            fingerprint = %key.fingerprint(HashAlg::Sha256),
            "Host key loaded."
        );
        keys.push(key);
    }
    Ok(keys)
}

#[derive(Debug, Clone, Copy)]
enum KeyKind {
    Ed25519,
    Rsa,
}

impl KeyKind {
    fn generate(self) -> Result<PrivateKey, HostKeyError> {
        let mut rng = rand::rng();
        let mut key = match self {
            KeyKind::Ed25519 => {
                PrivateKey::random(&mut rng, Algorithm::Ed25519).map_err(|source| {
                    HostKeyError::Generate {
                        algorithm: "ed25519",
                        source,
                    }
                })?
            }
            KeyKind::Rsa => RsaKeypair::random(&mut rng, RSA_BITS)
                .map(PrivateKey::from)
                .map_err(|source| HostKeyError::Generate {
                    algorithm: "rsa",
                    source,
                })?,
        };
        key.set_comment("ongrid-gateway host key");
        Ok(key)
    }
}

fn load(path: &Path) -> Result<PrivateKey, HostKeyError> {
    let metadata = std::fs::metadata(path).map_err(|source| HostKeyError::Read {
        path: path.to_owned(),
        source,
    })?;
    let mode = metadata.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(HostKeyError::Unprotected {
            path: path.to_owned(),
            mode,
        });
    }
    let text = std::fs::read_to_string(path).map_err(|source| HostKeyError::Read {
        path: path.to_owned(),
        source,
    })?;
    let key = PrivateKey::from_openssh(&text).map_err(|source| HostKeyError::Parse {
        path: path.to_owned(),
        source,
    })?;
    if key.is_encrypted() {
        return Err(HostKeyError::Encrypted {
            path: path.to_owned(),
        });
    }
    Ok(key)
}

/// Writes the private key (0600, through a temporary file renamed into place so a crash never
/// leaves half a key) and its `.pub` file.
fn write(path: &Path, key: &PrivateKey) -> Result<(), HostKeyError> {
    let write_error = |source| HostKeyError::Write {
        path: path.to_owned(),
        source,
    };
    let text = key
        .to_openssh(LineEnding::LF)
        .map_err(|e| write_error(std::io::Error::other(e)))?;
    let temporary = path.with_extension("tmp");
    let _ = std::fs::remove_file(&temporary);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&temporary)
        .map_err(write_error)?;
    file.write_all(text.as_bytes()).map_err(write_error)?;
    file.sync_all().map_err(write_error)?;
    drop(file);
    std::fs::rename(&temporary, path).map_err(write_error)?;
    let public = key
        .public_key()
        .to_openssh()
        .map_err(|e| write_error(std::io::Error::other(e)))?;
    let public_path = path.with_extension("pub");
    std::fs::write(&public_path, format!("{public}\n")).map_err(|source| HostKeyError::Write {
        path: public_path,
        source,
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_created_once_then_loaded() {
        let dir = tempfile::tempdir().unwrap();
        let keys_dir = dir.path().join("gateway");
        let first = load_or_create(&keys_dir).unwrap();
        assert_eq!(first.len(), 2);
        assert_eq!(first[0].algorithm(), Algorithm::Ed25519);
        assert!(matches!(first[1].algorithm(), Algorithm::Rsa { .. }));
        for file in [ED25519_FILE, RSA_FILE] {
            let mode = std::fs::metadata(keys_dir.join(file))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600, "{file}");
            let public = std::fs::read_to_string(keys_dir.join(format!("{file}.pub"))).unwrap();
            assert!(public.starts_with("ssh-"), "{public}");
        }
        let dir_mode = std::fs::metadata(&keys_dir).unwrap().permissions().mode();
        assert_eq!(dir_mode & 0o777, 0o700);

        let second = load_or_create(&keys_dir).unwrap();
        for (a, b) in first.iter().zip(&second) {
            assert_eq!(
                a.fingerprint(HashAlg::Sha256),
                b.fingerprint(HashAlg::Sha256)
            );
        }

        std::fs::set_permissions(
            keys_dir.join(ED25519_FILE),
            std::fs::Permissions::from_mode(0o644),
        )
        .unwrap();
        let error = load_or_create(&keys_dir).unwrap_err();
        assert!(error.to_string().contains("chmod 600"), "{error}");

        std::fs::write(keys_dir.join(ED25519_FILE), "not a key").unwrap();
        std::fs::set_permissions(
            keys_dir.join(ED25519_FILE),
            std::fs::Permissions::from_mode(0o600),
        )
        .unwrap();
        assert!(matches!(
            load_or_create(&keys_dir).unwrap_err(),
            HostKeyError::Parse { .. }
        ));
    }
}
