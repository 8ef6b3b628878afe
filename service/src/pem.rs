//! PEM files named in config: a certificate chain, a private key, and a CA directory in IGTF
//! layout (every `*.0` and `*.pem` file; CRLs `*.r0`, signing policies and other files are
//! skipped). Each error names the config key or directory, so the binaries can keep their own
//! messages by converting [`PemError`] and [`CaDirError`] into their error types.

use std::path::{Path, PathBuf};

use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// Why a PEM file named by config key `key` could not be used.
#[derive(Debug, thiserror::Error)]
pub enum PemError {
    #[error("reading {key} {}", path.display())]
    Read {
        key: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{key} {} holds no {what}: it must be PEM", path.display())]
    Empty {
        key: &'static str,
        path: PathBuf,
        what: &'static str,
    },
}

/// Why a CA directory could not be used.
#[derive(Debug, thiserror::Error)]
pub enum CaDirError {
    #[error("cannot read CA directory {dir}")]
    Dir {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read CA file {path}")]
    File {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("CA directory {0} holds no certificate (*.0 or *.pem)")]
    NoCertificate(PathBuf),
}

/// A CA certificate and the file it came from.
#[derive(Debug, Clone)]
pub struct CaCertificate {
    pub path: PathBuf,
    pub der: CertificateDer<'static>,
}

/// The certificates of the PEM file `path`, named in config by `key`; at least one.
pub fn read_certificates(
    key: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, PemError> {
    let pem = read(key, path)?;
    let certs = rustls_pemfile::certs(&mut pem.as_slice())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| PemError::Read {
            key,
            path: path.to_owned(),
            source,
        })?;
    if certs.is_empty() {
        return Err(PemError::Empty {
            key,
            path: path.to_owned(),
            what: "certificate",
        });
    }
    Ok(certs)
}

/// The first private key of the PEM file `path`, named in config by `key`.
pub fn read_private_key(
    key: &'static str,
    path: &Path,
) -> Result<PrivateKeyDer<'static>, PemError> {
    let pem = read(key, path)?;
    rustls_pemfile::private_key(&mut pem.as_slice())
        .map_err(|source| PemError::Read {
            key,
            path: path.to_owned(),
            source,
        })?
        .ok_or_else(|| PemError::Empty {
            key,
            path: path.to_owned(),
            what: "private key",
        })
}

fn read(key: &'static str, path: &Path) -> Result<Vec<u8>, PemError> {
    std::fs::read(path).map_err(|source| PemError::Read {
        key,
        path: path.to_owned(),
        source,
    })
}

/// The `*.0` and `*.pem` files of `dir` that are files, sorted; the error is listing `dir`.
pub fn ca_dir_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut paths = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let wanted = path
            .extension()
            .is_some_and(|ext| ext == "0" || ext == "pem");
        if wanted && path.is_file() {
            paths.push(path);
        }
    }
    paths.sort();
    Ok(paths)
}

/// The certificates of every `*.0` and `*.pem` file in `dir`; at least one.
pub fn load_ca_dir(dir: &Path) -> Result<Vec<CaCertificate>, CaDirError> {
    let mut certificates = Vec::new();
    let paths = ca_dir_files(dir).map_err(|source| CaDirError::Dir {
        dir: dir.to_owned(),
        source,
    })?;
    for path in paths {
        let pem = std::fs::read(&path).map_err(|source| CaDirError::File {
            path: path.clone(),
            source,
        })?;
        for der in rustls_pemfile::certs(&mut pem.as_slice()) {
            let der = der.map_err(|source| CaDirError::File {
                path: path.clone(),
                source,
            })?;
            certificates.push(CaCertificate {
                path: path.clone(),
                der,
            });
        }
    }
    if certificates.is_empty() {
        return Err(CaDirError::NoCertificate(dir.to_owned()));
    }
    Ok(certificates)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn self_signed() -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["node1.example.org".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    }

    #[test]
    fn a_certificate_and_key_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = self_signed();
        std::fs::write(dir.path().join("a.crt"), format!("{cert}{cert}")).unwrap();
        std::fs::write(dir.path().join("a.key"), key).unwrap();
        let chain = read_certificates("tls_cert", &dir.path().join("a.crt")).unwrap();
        assert_eq!(chain.len(), 2);
        read_private_key("tls_key", &dir.path().join("a.key")).unwrap();
    }

    #[test]
    fn bad_pem_names_the_key_and_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "not PEM at all").unwrap();
        let err = read_private_key("tls_key", &empty).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "tls_key {} holds no private key: it must be PEM",
                empty.display()
            )
        );
        let err = read_certificates("tls_cert", &empty).unwrap_err();
        assert!(
            matches!(
                err,
                PemError::Empty {
                    key: "tls_cert",
                    what: "certificate",
                    ..
                }
            ),
            "{err:?}"
        );

        let broken = dir.path().join("broken.pem");
        std::fs::write(
            &broken,
            "-----BEGIN CERTIFICATE-----\n!!!\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let err = read_certificates("tls_cert", &broken).unwrap_err();
        assert!(matches!(err, PemError::Read { .. }), "{err:?}");
        assert!(
            err.to_string().contains(&broken.display().to_string()),
            "{err}"
        );

        let missing = dir.path().join("missing.crt");
        let err = read_certificates("tls_cert", &missing).unwrap_err();
        assert!(err.to_string().starts_with("reading tls_cert "), "{err}");
    }

    #[test]
    fn ca_dir_loads_only_certificate_files() {
        let dir = tempfile::tempdir().unwrap();
        let (a, _) = self_signed();
        let (b, _) = self_signed();
        std::fs::write(dir.path().join("1a2b3c4d.0"), &a).unwrap();
        std::fs::write(dir.path().join("site.pem"), format!("{a}{b}")).unwrap();
        std::fs::write(dir.path().join("1a2b3c4d.r0"), "not a certificate").unwrap();
        std::fs::write(dir.path().join("1a2b3c4d.signing_policy"), "x").unwrap();
        std::fs::create_dir(dir.path().join("sub.pem")).unwrap();
        let files = ca_dir_files(dir.path()).unwrap();
        assert_eq!(
            files,
            vec![dir.path().join("1a2b3c4d.0"), dir.path().join("site.pem")]
        );
        let certificates = load_ca_dir(dir.path()).unwrap();
        assert_eq!(certificates.len(), 3);
        assert_eq!(certificates[0].path, dir.path().join("1a2b3c4d.0"));
    }

    #[test]
    fn a_ca_dir_without_certificates_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("README"), "nothing here").unwrap();
        std::fs::write(dir.path().join("empty.0"), "").unwrap();
        let err = load_ca_dir(dir.path()).unwrap_err();
        assert!(matches!(err, CaDirError::NoCertificate(_)), "{err:?}");
        assert!(err.to_string().contains(&dir.path().display().to_string()));

        let absent = dir.path().join("absent");
        let err = load_ca_dir(&absent).unwrap_err();
        assert!(matches!(err, CaDirError::Dir { .. }), "{err:?}");
        assert!(err.to_string().contains(&absent.display().to_string()));
    }
}
