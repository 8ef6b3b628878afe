//! The trusted CA directory in IGTF layout (`/etc/grid-security/certificates`): CA certificates
//! in hash-named files `<8 hex>.<n>` and their CRLs in `<8 hex>.r<n>`, PEM (CRLs also DER). Other
//! files (`.signing_policy`, `.namespaces`, `.info`, `.pem` copies) are not read. Loaded once;
//! a file that cannot be read is a warning, not an error, so one bad file in a large IGTF bundle
//! does not lock everyone out; a directory without any CA is an error.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use x509_parser::prelude::{FromDer, X509Certificate};
use x509_parser::revocation_list::CertificateRevocationList;

use crate::dn;

/// Why a CA directory could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum CaDirError {
    #[error("cannot read the CA directory {dir}: {source}: check the path (the IGTF bundle is usually /etc/grid-security/certificates)")]
    Read {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("no CA certificates (hash-named files like 1a2b3c4d.0) in {dir}{details}: install the IGTF CA bundle there or point the setting at the right directory")]
    NoCas { dir: PathBuf, details: String },
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
    /// Loads `<hash>.<n>` CA certificates and `<hash>.r<n>` CRLs from `dir`.
    pub fn load(dir: &Path) -> Result<CaDir, CaDirError> {
        let read_error = |source| CaDirError::Read {
            dir: dir.to_owned(),
            source,
        };
        let mut names: Vec<PathBuf> = fs::read_dir(dir)
            .map_err(read_error)?
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .collect();
        names.sort();
        let mut cas = Vec::new();
        let mut crls = Vec::new();
        let mut warnings = Vec::new();
        for path in names {
            let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            let kind = file_kind(name);
            if kind == FileKind::Other {
                continue;
            }
            let bytes = match fs::read(&path) {
                Ok(bytes) => bytes,
                Err(e) => {
                    warnings.push(format!("cannot read {}: {e}", path.display()));
                    continue;
                }
            };
            match kind {
                FileKind::Ca => match pem_blocks(&bytes, "CERTIFICATE") {
                    Ok(ders) if !ders.is_empty() => cas.extend(ders),
                    Ok(_) => warnings.push(format!("{} holds no PEM certificate", path.display())),
                    Err(e) => warnings.push(format!("cannot read {}: {e}", path.display())),
                },
                FileKind::Crl => match pem_blocks(&bytes, "X509 CRL") {
                    Ok(ders) if !ders.is_empty() => crls.extend(ders),
                    // A DER CRL.
                    _ if bytes.first() == Some(&0x30) => crls.push(bytes),
                    _ => warnings.push(format!("{} holds no CRL", path.display())),
                },
                FileKind::Other => {}
            }
        }
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

/// `1a2b3c4d.0` → Ca, `1a2b3c4d.r0` → Crl.
fn file_kind(name: &str) -> FileKind {
    let Some((hash, suffix)) = name.split_once('.') else {
        return FileKind::Other;
    };
    if hash.len() != 8 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
        return FileKind::Other;
    }
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if digits(suffix) {
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

    #[test]
    fn igtf_file_names() {
        assert_eq!(file_kind("1a2b3c4d.0"), FileKind::Ca);
        assert_eq!(file_kind("1a2b3c4d.12"), FileKind::Ca);
        assert_eq!(file_kind("1a2b3c4d.r0"), FileKind::Crl);
        assert_eq!(file_kind("1a2b3c4d.signing_policy"), FileKind::Other);
        assert_eq!(file_kind("1a2b3c4d.namespaces"), FileKind::Other);
        assert_eq!(file_kind("SomeCA.pem"), FileKind::Other);
        assert_eq!(file_kind("1a2b3c4.0"), FileKind::Other);
        assert_eq!(file_kind("1a2b3c4d.r"), FileKind::Other);
    }

    #[test]
    fn a_bad_file_is_a_warning_and_the_rest_loads() {
        let dir = tempfile::tempdir().unwrap();
        // The fuzz targets' fixed test CA (a CA certificate only, no key).
        std::fs::write(
            dir.path().join("bbbbbbbb.0"),
            include_bytes!("../fuzz/ca.pem"),
        )
        .unwrap();
        std::fs::write(dir.path().join("aaaaaaaa.0"), b"not a certificate").unwrap();
        std::fs::write(dir.path().join("bbbbbbbb.r0"), b"not a crl").unwrap();
        std::fs::write(dir.path().join("bbbbbbbb.signing_policy"), b"ignored").unwrap();
        let cas = CaDir::load(dir.path()).unwrap();
        assert_eq!(cas.len(), 1);
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
