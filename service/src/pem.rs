//! PEM files named in config: a certificate chain, a private key, and a CA directory in IGTF
//! layout, read strictly with `ongrid_x509`'s reader ([`load_ca_dir`]). Each error names the
//! config key, the file or the directory; the binaries wrap [`PemError`] and [`CaDirError`] in
//! their own errors with what their operator should do.

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

pub use ongrid_x509::{CaCertificate, CaDirError};

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

/// The CA certificates of `dir` (IGTF layout: `<hash>.0`, `*.pem`; CRLs and other files are not
/// read), at least one. Read strictly: a CA file that cannot be used is an error naming it, so
/// a daemon finds out at start-up, not at its first TLS handshake (see `ongrid_x509::CaDirMode`).
pub fn load_ca_dir(dir: &Path) -> Result<Vec<CaCertificate>, CaDirError> {
    Ok(ongrid_x509::read_ca_dir(dir, ongrid_x509::CaDirMode::Strict)?.certificates)
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
        std::fs::write(dir.path().join("1a2b3c4d.1"), &b).unwrap();
        std::fs::write(dir.path().join("site.pem"), format!("{a}{b}")).unwrap();
        std::fs::write(dir.path().join("1a2b3c4d.r0"), "not a certificate").unwrap();
        std::fs::write(dir.path().join("1a2b3c4d.signing_policy"), "x").unwrap();
        std::fs::create_dir(dir.path().join("sub.pem")).unwrap();
        let certificates = load_ca_dir(dir.path()).unwrap();
        let paths: Vec<_> = certificates.iter().map(|c| c.path.clone()).collect();
        assert_eq!(
            paths,
            vec![
                dir.path().join("1a2b3c4d.0"),
                dir.path().join("1a2b3c4d.1"),
                dir.path().join("site.pem"),
                dir.path().join("site.pem"),
            ]
        );
    }

    #[test]
    fn a_bad_ca_file_or_an_empty_ca_dir_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("README"), "nothing here").unwrap();
        let err = load_ca_dir(dir.path()).unwrap_err();
        assert!(matches!(err, CaDirError::NoCas { .. }), "{err:?}");
        assert!(err.to_string().contains(&dir.path().display().to_string()));

        // Strict: one broken file among good ones stops the daemon, naming the file.
        let (a, _) = self_signed();
        std::fs::write(dir.path().join("1a2b3c4d.0"), &a).unwrap();
        std::fs::write(dir.path().join("empty.0"), "").unwrap();
        let err = load_ca_dir(dir.path()).unwrap_err();
        assert!(matches!(err, CaDirError::BadFile { .. }), "{err:?}");
        assert!(
            err.to_string()
                .contains(&dir.path().join("empty.0").display().to_string()),
            "{err}"
        );

        let absent = dir.path().join("absent");
        let err = load_ca_dir(&absent).unwrap_err();
        assert!(matches!(err, CaDirError::Read { .. }), "{err:?}");
        assert!(err.to_string().contains(&absent.display().to_string()));
    }
}
