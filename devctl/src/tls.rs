//! The TLS side of talking to the manager: the user's certificate (a grid proxy, or a certificate
//! and key) presented as the client certificate, and the CA directory (`<hash>.0` or `*.pem` PEM
//! files, the IGTF layout) that the manager's server certificate must chain to.
//!
//! devctl builds the `rustls` client configuration itself (ring provider, TLS 1.2 and 1.3) and
//! hands it to reqwest, so that every problem with the files gets its own message, and so that
//! the subject DN and expiry of the certificate are known when the manager refuses it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use chrono::{DateTime, Utc};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls_pemfile::Item;

use crate::config::{Credentials, Origin, Setting};

/// Why the certificate, key or CA directory cannot be used. Each message names the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TlsSetupError {
    #[error("cannot read {what} {} (from {origin}): {cause}: {}", path.display(), fix_for(origin))]
    Unreadable {
        what: &'static str,
        path: PathBuf,
        origin: Origin,
        cause: String,
    },
    #[error("{} (from {origin}) holds no PEM certificate: point {origin} at your certificate or proxy file", path.display())]
    NoCertificate { path: PathBuf, origin: Origin },
    #[error("no private key in {} (from {origin}): a proxy file holds both certificate and key (run voms-proxy-init again); for a separate key set X509_USER_KEY", path.display())]
    NoKey { path: PathBuf, origin: Origin },
    #[error("the private key in {} is encrypted, which devctl cannot use: make a proxy with voms-proxy-init (or grid-proxy-init) and use that", path.display())]
    EncryptedKey { path: PathBuf },
    #[error("the private key in {} does not belong to the certificate in {} (from {origin}): use the matching pair, or run voms-proxy-init for a new proxy", key.display(), cert.display())]
    KeyMismatch {
        cert: PathBuf,
        key: PathBuf,
        origin: Origin,
    },
    #[error("the certificate from {origin} cannot be used ({cause}): a grid certificate or proxy is an X.509 v3 certificate in PEM")]
    BadIdentity { origin: Origin, cause: String },
    #[error("cannot read the CA directory {} (from {origin}): {cause}: set X509_CERT_DIR to the directory of the site's CA certificates", dir.display())]
    CaDirUnreadable {
        dir: PathBuf,
        origin: Origin,
        cause: String,
    },
    #[error("no usable CA certificate (*.0 or *.pem) in {} (from {origin}): set X509_CERT_DIR to the directory of the site's CA certificates", dir.display())]
    NoCas { dir: PathBuf, origin: Origin },
}

fn fix_for(origin: &Origin) -> String {
    match origin {
        Origin::Default => "run voms-proxy-init (or grid-proxy-init) to make a proxy".to_owned(),
        other => format!("correct {other}, or run voms-proxy-init for a new proxy"),
    }
}

/// The user's certificate chain and key, read and checked.
#[derive(Debug)]
pub struct UserCertificate {
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    /// The identity the manager will see: the subject DN of the end-entity certificate (the
    /// issuer of a proxy), in slash form. `None` when the certificate cannot be parsed.
    pub identity: Option<String>,
    /// The earliest expiry in the chain (a proxy expires before its end-entity certificate).
    pub not_after: Option<DateTime<Utc>>,
}

impl UserCertificate {
    /// Reads the certificate (and key, if it is another file) named by `credentials`.
    pub fn load(credentials: &Credentials) -> Result<Self, TlsSetupError> {
        let cert_text = read(&credentials.cert, "certificate", &credentials.origin)?;
        let key_text = if credentials.key == credentials.cert {
            None
        } else {
            Some(read(&credentials.key, "private key", &credentials.origin)?)
        };
        let key_text = key_text.as_deref().unwrap_or(&cert_text);
        // Both the PKCS#8 and the traditional OpenSSL way of encrypting a key.
        if key_text.contains("-----BEGIN ENCRYPTED PRIVATE KEY-----")
            || key_text.contains("Proc-Type: 4,ENCRYPTED")
        {
            return Err(TlsSetupError::EncryptedKey {
                path: credentials.key.clone(),
            });
        }
        let chain: Vec<CertificateDer<'static>> =
            pem_items(&cert_text, &credentials.cert, &credentials.origin)?
                .into_iter()
                .filter_map(|item| match item {
                    Item::X509Certificate(cert) => Some(cert),
                    _ => None,
                })
                .collect();
        let key: Option<PrivateKeyDer<'static>> =
            pem_items(key_text, &credentials.key, &credentials.origin)?
                .into_iter()
                .find_map(|item| match item {
                    Item::Pkcs1Key(k) => Some(k.into()),
                    Item::Pkcs8Key(k) => Some(k.into()),
                    Item::Sec1Key(k) => Some(k.into()),
                    _ => None,
                });
        if chain.is_empty() {
            return Err(TlsSetupError::NoCertificate {
                path: credentials.cert.clone(),
                origin: credentials.origin.clone(),
            });
        }
        let key = key.ok_or_else(|| TlsSetupError::NoKey {
            path: credentials.key.clone(),
            origin: credentials.origin.clone(),
        })?;
        let identity = identity_dn(&chain);
        let not_after = chain.iter().filter_map(|c| not_after(c)).min();
        Ok(Self {
            chain,
            key,
            identity,
            not_after,
        })
    }
}

fn read(path: &Path, what: &'static str, origin: &Origin) -> Result<String, TlsSetupError> {
    std::fs::read_to_string(path).map_err(|err| TlsSetupError::Unreadable {
        what,
        path: path.to_path_buf(),
        origin: origin.clone(),
        cause: err.to_string(),
    })
}

fn pem_items(text: &str, path: &Path, origin: &Origin) -> Result<Vec<Item>, TlsSetupError> {
    rustls_pemfile::read_all(&mut text.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| TlsSetupError::Unreadable {
            what: "PEM file",
            path: path.to_path_buf(),
            origin: origin.clone(),
            cause: err.to_string(),
        })
}

/// Reads every CA certificate of an IGTF-style directory: files named `<hash>.<digit(s)>` or
/// `*.pem`. CRLs (`.r0`), signing policies and other files are skipped, and so are certificates
/// rustls cannot use as trust anchors.
pub fn load_ca_dir(dir: &Setting<PathBuf>) -> Result<rustls::RootCertStore, TlsSetupError> {
    let unreadable = |cause: String| TlsSetupError::CaDirUnreadable {
        dir: dir.value.clone(),
        origin: dir.origin.clone(),
        cause,
    };
    let entries = std::fs::read_dir(&dir.value).map_err(|e| unreadable(e.to_string()))?;
    let mut paths = Vec::new();
    for entry in entries {
        let path = entry.map_err(|e| unreadable(e.to_string()))?.path();
        if is_ca_file(&path) {
            paths.push(path);
        }
    }
    paths.sort();
    let mut roots = rustls::RootCertStore::empty();
    for path in paths {
        // A broken or unreadable file among many CAs is left out rather than failing
        // everything, as grid clients do; if none is left, `NoCas` says so.
        let Ok(bytes) = std::fs::read(&path) else {
            continue;
        };
        let mut reader = bytes.as_slice();
        let certs: Vec<_> = rustls_pemfile::certs(&mut reader)
            .filter_map(Result::ok)
            .collect();
        roots.add_parsable_certificates(certs);
    }
    if roots.is_empty() {
        return Err(TlsSetupError::NoCas {
            dir: dir.value.clone(),
            origin: dir.origin.clone(),
        });
    }
    Ok(roots)
}

fn is_ca_file(path: &Path) -> bool {
    match path.extension().and_then(|e| e.to_str()) {
        Some("pem") => true,
        Some(ext) => !ext.is_empty() && ext.bytes().all(|b| b.is_ascii_digit()),
        None => false,
    }
}

/// The rustls client configuration: trust `roots`, present `user` (read from `credentials`).
pub fn client_config(
    roots: rustls::RootCertStore,
    user: &UserCertificate,
    credentials: &Credentials,
) -> Result<rustls::ClientConfig, TlsSetupError> {
    let bad = |err: rustls::Error| match err {
        rustls::Error::InconsistentKeys(_) => TlsSetupError::KeyMismatch {
            cert: credentials.cert.clone(),
            key: credentials.key.clone(),
            origin: credentials.origin.clone(),
        },
        other => TlsSetupError::BadIdentity {
            origin: credentials.origin.clone(),
            cause: other.to_string(),
        },
    };
    rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(bad)?
        .with_root_certificates(roots)
        .with_client_auth_cert(user.chain.clone(), user.key.clone_key())
        .map_err(bad)
}

/// The identity in a chain: the subject of the first certificate, or, while that certificate is
/// a proxy (its subject is its issuer's plus one `CN=` component, as for RFC 3820 and legacy
/// proxies), the subject of its issuer.
pub fn identity_dn(chain: &[CertificateDer<'_>]) -> Option<String> {
    let names: Vec<(String, String)> = chain
        .iter()
        .filter_map(|der| {
            let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
            Some((slash_dn(cert.subject()), slash_dn(cert.issuer())))
        })
        .collect();
    let (mut subject, mut issuer) = names.first()?.clone();
    loop {
        let is_proxy = subject
            .strip_prefix(issuer.as_str())
            .and_then(|rest| rest.strip_prefix("/CN="))
            .is_some_and(|cn| !cn.contains('/'));
        if !is_proxy {
            return Some(subject);
        }
        subject = issuer;
        // Each step shortens `subject`, so this ends.
        match names.iter().find(|(s, _)| *s == subject) {
            Some((_, next_issuer)) => issuer = next_issuer.clone(),
            None => return Some(subject),
        }
    }
}

fn not_after(der: &CertificateDer<'_>) -> Option<DateTime<Utc>> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    DateTime::from_timestamp(cert.validity().not_after.timestamp(), 0)
}

/// A name in the grid's slash form, RDNs in certificate order: `/DC=org/DC=example/CN=Alice`.
pub fn slash_dn(name: &x509_parser::x509::X509Name<'_>) -> String {
    let mut out = String::new();
    for rdn in name.iter_rdn() {
        out.push('/');
        let parts: Vec<String> = rdn
            .iter()
            .map(|attr| {
                let oid = attr.attr_type().to_id_string();
                let key = attribute_name(&oid).unwrap_or(&oid).to_owned();
                let value = attr.as_str().unwrap_or("?");
                format!("{key}={value}")
            })
            .collect();
        out.push_str(&parts.join("+"));
    }
    out
}

/// Short names as `openssl x509 -subject -nameopt compat` prints them.
fn attribute_name(oid: &str) -> Option<&'static str> {
    Some(match oid {
        "2.5.4.3" => "CN",
        "2.5.4.5" => "serialNumber",
        "2.5.4.6" => "C",
        "2.5.4.7" => "L",
        "2.5.4.8" => "ST",
        "2.5.4.10" => "O",
        "2.5.4.11" => "OU",
        "0.9.2342.19200300.100.1.25" => "DC",
        "0.9.2342.19200300.100.1.1" => "UID",
        "1.2.840.113549.1.9.1" => "emailAddress",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, KeyPair};

    const DC: [u64; 7] = [0, 9, 2342, 19200300, 100, 1, 25];
    const CN: [u64; 4] = [2, 5, 4, 3];

    fn params(parts: Vec<(DnType, &str)>) -> CertificateParams {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        let mut dn = DistinguishedName::new();
        for (ty, value) in parts {
            dn.push(ty, value);
        }
        params.distinguished_name = dn;
        params
    }

    /// A CA, a user certificate it signed, and a proxy the user certificate signed.
    fn proxy_chain() -> (
        rcgen::Certificate,
        rcgen::Certificate,
        KeyPair,
        rcgen::Certificate,
    ) {
        let ca_key = KeyPair::generate().unwrap();
        let mut ca = params(vec![
            (DnType::CustomDnType(DC.to_vec()), "org"),
            (DnType::CommonName, "Test CA"),
        ]);
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = ca.self_signed(&ca_key).unwrap();
        let user_key = KeyPair::generate().unwrap();
        let user = params(vec![
            (DnType::CustomDnType(DC.to_vec()), "org"),
            (DnType::OrganizationName, "Example"),
            (DnType::CommonName, "Alice Smith"),
        ])
        .signed_by(&user_key, &ca, &ca_key)
        .unwrap();
        let proxy_key = KeyPair::generate().unwrap();
        let proxy = params(vec![
            (DnType::CustomDnType(DC.to_vec()), "org"),
            (DnType::OrganizationName, "Example"),
            (DnType::CommonName, "Alice Smith"),
            // rcgen keeps one value per type, so the proxy's own CN goes in under its OID.
            (DnType::CustomDnType(CN.to_vec()), "1234567"),
        ])
        .signed_by(&proxy_key, &user, &user_key)
        .unwrap();
        (ca, user, proxy_key, proxy)
    }

    #[test]
    fn slash_form_keeps_rdn_order() {
        let (ca, user, _, proxy) = proxy_chain();
        assert_eq!(
            identity_dn(&[ca.der().clone()]).unwrap(),
            "/DC=org/CN=Test CA"
        );
        assert_eq!(
            identity_dn(&[user.der().clone()]).unwrap(),
            "/DC=org/O=Example/CN=Alice Smith"
        );
        let (_, parsed) = x509_parser::parse_x509_certificate(proxy.der()).unwrap();
        assert_eq!(
            slash_dn(parsed.subject()),
            "/DC=org/O=Example/CN=Alice Smith/CN=1234567"
        );
    }

    #[test]
    fn a_proxy_is_known_by_its_owner() {
        let (_, user, _, proxy) = proxy_chain();
        let chain = [proxy.der().clone(), user.der().clone()];
        assert_eq!(
            identity_dn(&chain).unwrap(),
            "/DC=org/O=Example/CN=Alice Smith"
        );
        // Without the user certificate in the file, the proxy's issuer still names the owner.
        assert_eq!(
            identity_dn(&chain[..1]).unwrap(),
            "/DC=org/O=Example/CN=Alice Smith"
        );
    }

    #[test]
    fn a_proxy_file_loads_with_its_key() {
        let (_, user, proxy_key, proxy) = proxy_chain();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x509up_u1000");
        let text = format!("{}{}{}", proxy.pem(), proxy_key.serialize_pem(), user.pem());
        std::fs::write(&path, text).unwrap();
        let creds = Credentials {
            cert: path.clone(),
            key: path,
            origin: Origin::Env("X509_USER_PROXY"),
        };
        let loaded = UserCertificate::load(&creds).unwrap();
        assert_eq!(loaded.chain.len(), 2);
        assert_eq!(
            loaded.identity.as_deref(),
            Some("/DC=org/O=Example/CN=Alice Smith")
        );
        assert!(loaded.not_after.is_some());
    }

    #[test]
    fn a_certificate_and_key_in_two_files_load() {
        let (_, _, proxy_key, proxy) = proxy_chain();
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
        std::fs::write(&cert, proxy.pem()).unwrap();
        std::fs::write(&key, proxy_key.serialize_pem()).unwrap();
        let creds = Credentials {
            cert: cert.clone(),
            key: key.clone(),
            origin: Origin::Env("X509_USER_CERT"),
        };
        let loaded = UserCertificate::load(&creds).unwrap();
        assert_eq!(loaded.chain.len(), 1);
        let mut roots = rustls::RootCertStore::empty();
        roots.add(proxy.der().clone()).unwrap();
        assert!(client_config(roots, &loaded, &creds).is_ok());

        // The key is taken from the key file only.
        let swapped = Credentials {
            cert: key,
            key: cert,
            origin: Origin::Env("X509_USER_CERT"),
        };
        let err = UserCertificate::load(&swapped).unwrap_err();
        assert!(matches!(err, TlsSetupError::NoCertificate { .. }), "{err}");
    }

    #[test]
    fn file_problems_have_their_own_messages() {
        let (_, user, _, _) = proxy_chain();
        let dir = tempfile::tempdir().unwrap();
        let creds = |name: &str| {
            let path = dir.path().join(name);
            Credentials {
                cert: path.clone(),
                key: path,
                origin: Origin::Env("X509_USER_PROXY"),
            }
        };
        let err = UserCertificate::load(&creds("missing")).unwrap_err();
        assert!(
            err.to_string().starts_with(&format!(
                "cannot read certificate {} (from X509_USER_PROXY): ",
                dir.path().join("missing").display()
            )),
            "{err}"
        );

        std::fs::write(dir.path().join("certonly"), user.pem()).unwrap();
        let err = UserCertificate::load(&creds("certonly")).unwrap_err();
        assert!(matches!(err, TlsSetupError::NoKey { .. }), "{err}");

        std::fs::write(dir.path().join("empty"), "not pem\n").unwrap();
        let err = UserCertificate::load(&creds("empty")).unwrap_err();
        assert!(matches!(err, TlsSetupError::NoCertificate { .. }), "{err}");

        let encrypted = format!(
            "{}-----BEGIN ENCRYPTED PRIVATE KEY-----\nAAAA\n-----END ENCRYPTED PRIVATE KEY-----\n",
            user.pem()
        );
        std::fs::write(dir.path().join("enc"), encrypted).unwrap();
        let err = UserCertificate::load(&creds("enc")).unwrap_err();
        assert!(matches!(err, TlsSetupError::EncryptedKey { .. }), "{err}");
    }

    #[test]
    fn a_key_of_another_certificate_is_refused() {
        let (ca, user, proxy_key, _) = proxy_chain();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mixed");
        std::fs::write(
            &path,
            format!("{}{}", user.pem(), proxy_key.serialize_pem()),
        )
        .unwrap();
        let creds = Credentials {
            cert: path.clone(),
            key: path,
            origin: Origin::Flag("cert"),
        };
        let loaded = UserCertificate::load(&creds).unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.der().clone()).unwrap();
        let err = client_config(roots, &loaded, &creds).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "the private key in {0} does not belong to the certificate in {0} (from --cert): \
                 use the matching pair, or run voms-proxy-init for a new proxy",
                creds.cert.display()
            )
        );
    }

    #[test]
    fn ca_dir_takes_hash_files_and_pem_only() {
        let (ca, user, _, _) = proxy_chain();
        let dir = tempfile::tempdir().unwrap();
        let setting = Setting {
            value: dir.path().to_path_buf(),
            origin: Origin::Env("X509_CERT_DIR"),
        };
        std::fs::write(dir.path().join("abcd1234.r0"), "crl").unwrap();
        std::fs::write(dir.path().join("abcd1234.signing_policy"), "x").unwrap();
        let err = load_ca_dir(&setting).unwrap_err();
        assert!(matches!(err, TlsSetupError::NoCas { .. }), "{err}");
        assert!(err.to_string().contains("set X509_CERT_DIR"), "{err}");

        std::fs::write(dir.path().join("abcd1234.0"), ca.pem()).unwrap();
        std::fs::write(dir.path().join("other.pem"), user.pem()).unwrap();
        std::fs::write(dir.path().join("broken.1"), "garbage").unwrap();
        assert_eq!(load_ca_dir(&setting).unwrap().len(), 2);

        let missing = Setting {
            value: dir.path().join("nope"),
            origin: Origin::Default,
        };
        let err = load_ca_dir(&missing).unwrap_err();
        assert!(
            matches!(err, TlsSetupError::CaDirUnreadable { .. }),
            "{err}"
        );
    }
}
