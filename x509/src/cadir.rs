//! The trusted CA directory in IGTF layout (`/etc/grid-security/certificates`), and the one
//! reader of such directories that every ongrid program uses ([`read_ca_dir`]).
//!
//! Files: CA certificates are PEM files named `<name>.<n>` (OpenSSL's hashed layout,
//! `1a2b3c4d.0`, where `<n>` tells apart CAs whose subjects hash alike) or `<name>.pem` (the
//! IGTF bundle's own copies: the same CA twice is kept once); CRLs are `<name>.r<n>`, PEM or
//! DER, and only [`CaDir`] reads them. Everything else (`.signing_policy`, `.namespaces`,
//! `.info`, directories) is not read.
//!
//! A CA file that cannot be read, is not PEM, holds no certificate or a certificate that is not
//! X.509 is treated as the [`CaDirMode`] says:
//! - [`CaDirMode::Lenient`], as grid clients (OpenSSL, Globus) read the directory: the file is
//!   skipped and named in the warnings, so one bad file in a bundle of a hundred CAs locks
//!   nobody out. devctl reads so, and so does the manager's [`CaDir`], which holds the users'
//!   CAs, usually the whole IGTF bundle.
//! - [`CaDirMode::Strict`]: the file is an error naming it. The gateway and the agents read so:
//!   their `ca_dir` only has to hold the CA of the site's own server certificates, and an error
//!   at start-up (or from `--check-config`) beats a TLS failure later that names no file.
//!
//! In both modes a directory that cannot be listed, or holds no usable CA certificate, is an
//! error. [`CaDir`] is loaded once; the caller decides when to load it again.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use x509_parser::prelude::{FromDer, X509Certificate};
use x509_parser::revocation_list::CertificateRevocationList;

use crate::dn;

/// Why a CA directory could not be used.
#[derive(Debug, thiserror::Error)]
pub enum CaDirError {
    #[error("cannot read the CA directory {} (the IGTF bundle is usually /etc/grid-security/certificates)", dir.display())]
    Read {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Strict mode only: a CA file that cannot be read.
    #[error("cannot read the CA file {}", path.display())]
    File {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Strict mode only: a CA file that is not PEM, or holds no usable certificate.
    #[error("the CA file {} {problem}: fix or remove it", path.display())]
    BadFile { path: PathBuf, problem: String },
    #[error("no CA certificates (files like 1a2b3c4d.0 or ca.pem) in {}{details}: install the IGTF CA bundle there or point the setting at the right directory", dir.display())]
    NoCas { dir: PathBuf, details: String },
}

/// How [`read_ca_dir`] treats a CA file it cannot use (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaDirMode {
    /// The file is an error naming it.
    Strict,
    /// The file is skipped and named in [`CaCertificates::skipped`].
    Lenient,
}

/// A CA certificate (DER) and the file it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaCertificate {
    pub path: PathBuf,
    pub der: Vec<u8>,
}

/// The CA certificates of a directory, at least one, in file-name order.
#[derive(Debug, Clone)]
pub struct CaCertificates {
    pub certificates: Vec<CaCertificate>,
    /// Lenient mode: the files left out and why, one sentence each; empty in strict mode.
    pub skipped: Vec<String>,
}

/// Reads the CA certificates of `dir` (`<name>.<n>` and `<name>.pem` files), treating a file it
/// cannot use as `mode` says.
pub fn read_ca_dir(dir: &Path, mode: CaDirMode) -> Result<CaCertificates, CaDirError> {
    let listing = list(dir)?;
    let read = read_certificates(&listing.cas, mode)?;
    if read.certificates.is_empty() {
        return Err(no_cas(dir, &read.skipped));
    }
    Ok(read)
}

/// The CA and CRL files of a directory, sorted by name.
struct Listing {
    cas: Vec<PathBuf>,
    crls: Vec<PathBuf>,
}

fn list(dir: &Path) -> Result<Listing, CaDirError> {
    let read_error = |source| CaDirError::Read {
        dir: dir.to_owned(),
        source,
    };
    let mut listing = Listing {
        cas: Vec::new(),
        crls: Vec::new(),
    };
    for entry in fs::read_dir(dir).map_err(read_error)? {
        let path = entry.map_err(read_error)?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let kind = file_kind(name);
        // Symbolic links (the IGTF bundle's `<hash>.0 -> <alias>.pem`) are followed.
        if kind == FileKind::Other || !path.is_file() {
            continue;
        }
        match kind {
            FileKind::Ca => listing.cas.push(path),
            FileKind::Crl => listing.crls.push(path),
            FileKind::Other => {}
        }
    }
    listing.cas.sort();
    listing.crls.sort();
    Ok(listing)
}

fn read_certificates(paths: &[PathBuf], mode: CaDirMode) -> Result<CaCertificates, CaDirError> {
    let mut read = CaCertificates {
        certificates: Vec::new(),
        skipped: Vec::new(),
    };
    for path in paths {
        match read_ca_file(path) {
            Ok(ders) => read
                .certificates
                .extend(ders.into_iter().map(|der| CaCertificate {
                    path: path.clone(),
                    der,
                })),
            Err(error) if mode == CaDirMode::Lenient => read.skipped.push(sentence(&error)),
            Err(error) => return Err(error),
        }
    }
    Ok(read)
}

/// The certificates of one CA file: PEM, at least one, each X.509.
fn read_ca_file(path: &Path) -> Result<Vec<Vec<u8>>, CaDirError> {
    let bad = |problem: String| CaDirError::BadFile {
        path: path.to_owned(),
        problem,
    };
    let bytes = fs::read(path).map_err(|source| CaDirError::File {
        path: path.to_owned(),
        source,
    })?;
    let ders = pem_blocks(&bytes, "CERTIFICATE").map_err(|e| bad(format!("is not PEM ({e})")))?;
    if ders.is_empty() {
        return Err(bad("holds no PEM certificate".to_owned()));
    }
    for der in &ders {
        if let Err(e) = X509Certificate::from_der(der) {
            return Err(bad(format!(
                "holds a certificate that is not valid X.509 ({e})"
            )));
        }
    }
    Ok(ders)
}

/// `error` and its cause as one sentence.
fn sentence(error: &CaDirError) -> String {
    match std::error::Error::source(error) {
        Some(source) => format!("{error}: {source}"),
        None => error.to_string(),
    }
}

fn no_cas(dir: &Path, warnings: &[String]) -> CaDirError {
    let details = if warnings.is_empty() {
        String::new()
    } else {
        format!(" ({})", warnings.join("; "))
    };
    CaDirError::NoCas {
        dir: dir.to_owned(),
        details,
    }
}

/// One trusted CA certificate.
#[derive(Debug, Clone)]
pub(crate) struct CaCert {
    pub der: Vec<u8>,
    pub subject_der: Vec<u8>,
}

/// The trusted CAs and CRLs of one directory.
#[derive(Debug, Clone)]
pub struct CaDir {
    dir: PathBuf,
    cas: Vec<CaCert>,
    by_subject: HashMap<String, Vec<usize>>,
    crls: HashMap<String, Vec<Vec<u8>>>,
    warnings: Vec<String>,
}

impl CaDir {
    /// Loads the CA certificates of `dir` leniently (see the module documentation) and its
    /// CRLs; a CRL file that cannot be used is a warning too.
    pub fn load(dir: &Path) -> Result<CaDir, CaDirError> {
        let listing = list(dir)?;
        let read = read_certificates(&listing.cas, CaDirMode::Lenient)?;
        let mut warnings = read.skipped;
        if read.certificates.is_empty() {
            return Err(no_cas(dir, &warnings));
        }
        let mut crls = Vec::new();
        for path in &listing.crls {
            let bytes = match fs::read(path) {
                Ok(bytes) => bytes,
                Err(e) => {
                    warnings.push(format!("cannot read {}: {e}", path.display()));
                    continue;
                }
            };
            match pem_blocks(&bytes, "X509 CRL") {
                Ok(ders) if !ders.is_empty() => crls.extend(ders),
                // A DER CRL.
                _ if bytes.first() == Some(&0x30) => crls.push(bytes),
                _ => warnings.push(format!("{} holds no CRL", path.display())),
            }
        }
        let cas = read.certificates.into_iter().map(|c| c.der).collect();
        let ca_dir = Self::from_parts(dir, cas, crls)?;
        Ok(CaDir {
            warnings: warnings.into_iter().chain(ca_dir.warnings).collect(),
            ..ca_dir
        })
    }

    /// A CA directory from DER certificates and CRLs already in memory; `dir` only names it in
    /// messages. Unparseable items are warnings, as in [`CaDir::load`].
    pub fn from_parts(
        dir: &Path,
        ca_ders: Vec<Vec<u8>>,
        crl_ders: Vec<Vec<u8>>,
    ) -> Result<CaDir, CaDirError> {
        let mut cas = Vec::new();
        let mut by_subject: HashMap<String, Vec<usize>> = HashMap::new();
        let mut crls: HashMap<String, Vec<Vec<u8>>> = HashMap::new();
        let mut warnings = Vec::new();
        for der in ca_ders {
            let parsed = match X509Certificate::from_der(&der) {
                Ok((_, cert)) => (
                    dn::display_name(cert.subject()),
                    cert.subject().as_raw().to_vec(),
                ),
                Err(e) => {
                    warnings.push(format!(
                        "a CA certificate in {} is not valid X.509: {e}",
                        dir.display()
                    ));
                    continue;
                }
            };
            let (subject, subject_der) = parsed;
            // The same CA is often present twice (`<hash>.0` and a `.pem` copy or a re-issue).
            if cas.iter().any(|c: &CaCert| c.der == der) {
                continue;
            }
            by_subject.entry(subject).or_default().push(cas.len());
            cas.push(CaCert { der, subject_der });
        }
        for der in crl_ders {
            match CertificateRevocationList::from_der(&der) {
                Ok((_, crl)) => crls
                    .entry(dn::display_name(crl.issuer()))
                    .or_default()
                    .push(der),
                Err(e) => warnings.push(format!("a CRL in {} is not valid: {e}", dir.display())),
            }
        }
        if cas.is_empty() {
            let details = if warnings.is_empty() {
                String::new()
            } else {
                format!(" ({})", warnings.join("; "))
            };
            return Err(CaDirError::NoCas {
                dir: dir.to_owned(),
                details,
            });
        }
        Ok(CaDir {
            dir: dir.to_owned(),
            cas,
            by_subject,
            crls,
            warnings,
        })
    }

    /// The DER subjects of the CAs, for the TLS CertificateRequest hints.
    pub fn subjects(&self) -> Vec<Vec<u8>> {
        self.cas.iter().map(|c| c.subject_der.clone()).collect()
    }

    /// The directory this was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// How many CA certificates were loaded.
    pub fn len(&self) -> usize {
        self.cas.len()
    }

    /// Always false: a CaDir without CAs is not made.
    pub fn is_empty(&self) -> bool {
        self.cas.is_empty()
    }

    /// Files or items that were skipped, one sentence each.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// The CA certificates whose subject is `subject` (slash form).
    pub(crate) fn by_subject(&self, subject: &str) -> impl Iterator<Item = &CaCert> {
        self.by_subject
            .get(subject)
            .into_iter()
            .flatten()
            .filter_map(|i| self.cas.get(*i))
    }

    /// The CRLs issued by `issuer` (slash form).
    pub(crate) fn crls_of(&self, issuer: &str) -> &[Vec<u8>] {
        self.crls.get(issuer).map(Vec::as_slice).unwrap_or(&[])
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FileKind {
    Ca,
    Crl,
    Other,
}

/// `1a2b3c4d.0`, `ca.pem` → Ca, `1a2b3c4d.r0` → Crl.
fn file_kind(name: &str) -> FileKind {
    let Some((stem, suffix)) = name.rsplit_once('.') else {
        return FileKind::Other;
    };
    if stem.is_empty() {
        return FileKind::Other;
    }
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if digits(suffix) || suffix == "pem" {
        FileKind::Ca
    } else if suffix.strip_prefix('r').is_some_and(digits) {
        FileKind::Crl
    } else {
        FileKind::Other
    }
}

/// The DER contents of the PEM blocks labelled `label` in `bytes`.
fn pem_blocks(bytes: &[u8], label: &str) -> Result<Vec<Vec<u8>>, String> {
    let mut out = Vec::new();
    let mut reader = bytes;
    loop {
        match rustls_pemfile::read_one_from_slice(reader) {
            Ok(Some((item, rest))) => {
                reader = rest;
                match (label, item) {
                    ("CERTIFICATE", rustls_pemfile::Item::X509Certificate(der)) => {
                        out.push(der.as_ref().to_vec())
                    }
                    ("X509 CRL", rustls_pemfile::Item::Crl(der)) => out.push(der.as_ref().to_vec()),
                    _ => {}
                }
            }
            Ok(None) => return Ok(out),
            Err(e) => return Err(format!("bad PEM: {e:?}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fuzz targets' fixed test CA (a CA certificate only, no key).
    const CA: &[u8] = include_bytes!("../fuzz/ca.pem");

    #[test]
    fn igtf_file_names() {
        assert_eq!(file_kind("1a2b3c4d.0"), FileKind::Ca);
        assert_eq!(file_kind("1a2b3c4d.12"), FileKind::Ca);
        assert_eq!(file_kind("testca.0"), FileKind::Ca);
        assert_eq!(file_kind("SomeCA.pem"), FileKind::Ca);
        assert_eq!(file_kind("1a2b3c4d.r0"), FileKind::Crl);
        assert_eq!(file_kind("1a2b3c4d.signing_policy"), FileKind::Other);
        assert_eq!(file_kind("1a2b3c4d.namespaces"), FileKind::Other);
        assert_eq!(file_kind("SomeCA.info"), FileKind::Other);
        assert_eq!(file_kind("1a2b3c4d.r"), FileKind::Other);
        assert_eq!(file_kind("1a2b3c4d.0.bak"), FileKind::Other);
        assert_eq!(file_kind(".pem"), FileKind::Other);
        assert_eq!(file_kind("README"), FileKind::Other);
    }

    /// A directory with one good CA, a copy of it as `.pem`, a broken CA file, a CRL that is
    /// not one, files that are not read, and a directory named like a CA file.
    fn mixed_dir() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("bbbbbbbb.0"), CA).unwrap();
        std::fs::write(dir.path().join("fuzz-ca.pem"), CA).unwrap();
        std::fs::write(dir.path().join("aaaaaaaa.0"), b"not a certificate").unwrap();
        std::fs::write(dir.path().join("bbbbbbbb.r0"), b"not a crl").unwrap();
        std::fs::write(dir.path().join("bbbbbbbb.signing_policy"), b"ignored").unwrap();
        std::fs::create_dir(dir.path().join("sub.pem")).unwrap();
        dir
    }

    #[test]
    fn lenient_reading_skips_a_bad_file_and_names_it() {
        let dir = mixed_dir();
        let read = read_ca_dir(dir.path(), CaDirMode::Lenient).unwrap();
        let paths: Vec<_> = read.certificates.iter().map(|c| c.path.clone()).collect();
        assert_eq!(
            paths,
            vec![
                dir.path().join("bbbbbbbb.0"),
                dir.path().join("fuzz-ca.pem")
            ]
        );
        assert_eq!(read.certificates[0].der, read.certificates[1].der);
        assert_eq!(read.skipped.len(), 1, "{:?}", read.skipped);
        let aaaa = dir.path().join("aaaaaaaa.0").display().to_string();
        assert!(read.skipped[0].contains(&aaaa), "{:?}", read.skipped);
        assert!(
            read.skipped[0].contains("no PEM certificate"),
            "{:?}",
            read.skipped
        );
    }

    #[test]
    fn strict_reading_refuses_a_bad_file_naming_it() {
        let dir = mixed_dir();
        let err = read_ca_dir(dir.path(), CaDirMode::Strict).unwrap_err();
        assert!(matches!(err, CaDirError::BadFile { .. }), "{err:?}");
        assert_eq!(
            err.to_string(),
            format!(
                "the CA file {} holds no PEM certificate: fix or remove it",
                dir.path().join("aaaaaaaa.0").display()
            )
        );

        // Broken PEM, and PEM that is not X.509.
        std::fs::write(
            dir.path().join("aaaaaaaa.0"),
            "-----BEGIN CERTIFICATE-----\n!!!\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let err = read_ca_dir(dir.path(), CaDirMode::Strict).unwrap_err();
        assert!(err.to_string().contains("is not PEM"), "{err}");
        std::fs::write(
            dir.path().join("aaaaaaaa.0"),
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let err = read_ca_dir(dir.path(), CaDirMode::Strict).unwrap_err();
        assert!(err.to_string().contains("not valid X.509"), "{err}");

        // Without it, the rest is read; CRLs and other files are not looked at.
        std::fs::remove_file(dir.path().join("aaaaaaaa.0")).unwrap();
        let read = read_ca_dir(dir.path(), CaDirMode::Strict).unwrap();
        assert_eq!(read.certificates.len(), 2);
        assert!(read.skipped.is_empty());
    }

    #[test]
    fn a_directory_without_a_usable_ca_is_an_error_in_both_modes() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("README"), "nothing here").unwrap();
        std::fs::write(dir.path().join("1a2b3c4d.r0"), "a CRL is no CA").unwrap();
        for mode in [CaDirMode::Strict, CaDirMode::Lenient] {
            let err = read_ca_dir(dir.path(), mode).unwrap_err();
            assert!(matches!(err, CaDirError::NoCas { .. }), "{err:?}");
            assert!(err.to_string().contains(&dir.path().display().to_string()));
        }
        // Lenient: the message says what was skipped.
        std::fs::write(dir.path().join("empty.0"), "").unwrap();
        let err = read_ca_dir(dir.path(), CaDirMode::Lenient).unwrap_err();
        assert!(err.to_string().contains("empty.0"), "{err}");

        let absent = dir.path().join("absent");
        for mode in [CaDirMode::Strict, CaDirMode::Lenient] {
            let err = read_ca_dir(&absent, mode).unwrap_err();
            assert!(matches!(err, CaDirError::Read { .. }), "{err:?}");
            assert!(err.to_string().contains(&absent.display().to_string()));
        }
    }

    #[test]
    fn a_bad_file_is_a_warning_and_the_rest_loads() {
        let dir = mixed_dir();
        let cas = CaDir::load(dir.path()).unwrap();
        assert_eq!(cas.len(), 1, "the .pem copy is the same CA");
        assert_eq!(cas.warnings().len(), 2, "{:?}", cas.warnings());
        assert_eq!(
            cas.by_subject("/DC=org/DC=ongrid-test/CN=ongrid fuzz CA")
                .count(),
            1
        );
    }

    #[test]
    fn an_empty_directory_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let err = CaDir::load(dir.path()).unwrap_err();
        assert!(matches!(err, CaDirError::NoCas { .. }));
        assert!(err.to_string().contains(&dir.path().display().to_string()));
    }
}
