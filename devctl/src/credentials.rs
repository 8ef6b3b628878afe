//! The TLS side of talking to the manager: the user's credential (a grid proxy, or a certificate
//! and key) presented as the client certificate (none with a bearer token: see
//! [`token_client_config`]), and the CA directory (IGTF layout: `<hash>.0`
//! or `*.pem` PEM files) that the manager's server certificate must chain to. The directory is
//! read with `ongrid_x509::read_ca_dir`, leniently as grid clients read it: a broken file among
//! many CAs is left out rather than failing every command.
//!
//! A proxy file holds the proxy, its key and the rest of the chain (the user certificate, and
//! the proxies between): all of it is presented, as grid tools do. Before connecting, the chain
//! is checked here with `ongrid_x509::verify_chain` against devctl's CA directory (on a grid UI
//! the IGTF bundle, which holds the user's CA too): expired, legacy or draft proxies and the like
//! are refused with one line naming the fix, instead of a TLS alert from the manager. Verdicts
//! about the CA itself (unknown here, revoked, stale CRL) are left to the manager, whose CA
//! directory is the one that counts.
//!
//! devctl builds the `rustls` client configuration itself (ring provider, TLS 1.2 and 1.3) and
//! hands it to reqwest, so that every problem with the files gets its own message, and so that
//! the subject DN, issuer and expiry of the credential are known when the manager refuses it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use chrono::{DateTime, Utc};
use ongrid_x509::{
    CaDir, CaDirError, CaDirMode, ChainError, ProxyKind, VerifiedChain, VerifyOptions,
};
use rustls::client::ResolvesClientCert;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;
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
    /// The key's file (a proxy's, or a separate key's) is open to others.
    #[error(transparent)]
    TooOpen(#[from] crate::permissions::TooOpen),
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
    /// The local check of the chain failed; `message` is `ongrid_x509`'s, which names the fix.
    #[error("cannot use {} (from {origin}): {message}", path.display())]
    Refused {
        path: PathBuf,
        origin: Origin,
        message: String,
    },
    #[error("cannot read the CA directory {} (from {origin}): {cause}: set X509_CERT_DIR to the directory of the site's CA certificates", dir.display())]
    CaDirUnreadable {
        dir: PathBuf,
        origin: Origin,
        cause: String,
    },
    #[error("no usable CA certificate (<hash>.0 or *.pem) in {} (from {origin}): set X509_CERT_DIR to the directory of the site's CA certificates", dir.display())]
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
    /// What the local check found: who, issued by which CA, until when; or why it failed.
    /// `Ok(None)`: only the manager can tell (the CA is not in devctl's CA directory, ...).
    inspected: Result<Option<VerifiedChain>, ChainError>,
    /// The identity the manager will see: the subject DN of the end-entity certificate (the
    /// issuer of a proxy), in slash form. `None` when the chain cannot be read.
    pub identity: Option<String>,
    /// The DN of the CA that issued the end-entity certificate.
    pub issuer: Option<String>,
    /// The earliest expiry in the chain (a proxy expires before its end-entity certificate).
    pub not_after: Option<DateTime<Utc>>,
}

impl UserCertificate {
    /// Reads the certificate (and key, if it is another file) named by `credentials`, and
    /// verifies the chain as it is at `now` against `cas` (when devctl's CA directory loads).
    pub fn load(
        credentials: &Credentials,
        cas: Option<&CaDir>,
        now: DateTime<Utc>,
    ) -> Result<Self, TlsSetupError> {
        // The file holding the key first: refused while others may read it, as ssh does.
        let key_file = if credentials.key == credentials.cert {
            "proxy file"
        } else {
            "private key file"
        };
        crate::permissions::check(&credentials.key, key_file)?;
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
        let der: Vec<Vec<u8>> = chain.iter().map(|c| c.as_ref().to_vec()).collect();
        let inspected = match cas {
            Some(cas) => match ongrid_x509::verify_chain(&der, cas, &VerifyOptions::at(now)) {
                Ok(verified) => Ok(Some(verified)),
                Err(error) if is_about_the_ca(&error) => Ok(None),
                Err(error) => Err(error),
            },
            None => Ok(None),
        };
        let (identity, issuer, not_after) = match &inspected {
            Ok(Some(verified)) => (
                Some(verified.identity.to_string()),
                Some(verified.end_entity_issuer.to_string()),
                Some(verified.not_after),
            ),
            // A proxy file ends with the user certificate: it names the holder and the CA.
            _ => {
                let last = der.last().map(Vec::as_slice).unwrap_or_default();
                (
                    ongrid_x509::dn_of(last).ok().map(|dn| dn.to_string()),
                    ongrid_x509::issuer_dn_of(last)
                        .ok()
                        .map(|dn| dn.to_string()),
                    None,
                )
            }
        };
        Ok(Self {
            chain,
            key,
            inspected,
            identity,
            issuer,
            not_after,
        })
    }

    /// The local verdict on the chain: every proxy rule and validity period, but not the CA
    /// (the manager checks that). Refusals name the fix: `voms-proxy-init`, `-rfc`, ...
    pub fn check(&self, credentials: &Credentials) -> Result<(), TlsSetupError> {
        match &self.inspected {
            Ok(_) => Ok(()),
            Err(error) => Err(TlsSetupError::Refused {
                path: credentials.cert.clone(),
                origin: credentials.origin.clone(),
                message: error.to_string(),
            }),
        }
    }

    /// The kind of credential (certificate or which proxy), when the local check could tell.
    pub fn kind(&self) -> Option<ProxyKind> {
        match &self.inspected {
            Ok(Some(verified)) => Some(verified.kind),
            _ => None,
        }
    }
}

/// Whether a refusal is about the CA rather than the user's own chain: devctl's CA directory may
/// lack the CA or hold an older CRL, and the manager's verdict is the one that counts.
fn is_about_the_ca(error: &ChainError) -> bool {
    matches!(
        error,
        ChainError::UnknownCa { .. }
            | ChainError::NotACa { .. }
            | ChainError::CaPathLen { .. }
            | ChainError::CaExpired { .. }
            | ChainError::Revoked { .. }
            | ChainError::CrlExpired { .. }
            | ChainError::CrlBadSignature { .. }
    )
}

/// The CA directory with its CRLs as `ongrid_x509` reads it, for the local check; `None` when it
/// holds no CA it can read ([`load_ca_dir`] reports the directory's problems).
pub fn load_grid_cas(dir: &Setting<PathBuf>) -> Option<CaDir> {
    CaDir::load(&dir.value).ok()
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

/// The CA certificates of the CA directory as rustls roots, read leniently
/// ([`CaDirMode::Lenient`]): files that cannot be read or are not PEM certificates are left out,
/// as grid clients do, and so are certificates rustls cannot use as trust anchors; if none is
/// left, [`TlsSetupError::NoCas`] says so.
pub fn load_ca_dir(dir: &Setting<PathBuf>) -> Result<rustls::RootCertStore, TlsSetupError> {
    let no_cas = || TlsSetupError::NoCas {
        dir: dir.value.clone(),
        origin: dir.origin.clone(),
    };
    let read =
        ongrid_x509::read_ca_dir(&dir.value, CaDirMode::Lenient).map_err(|error| match error {
            CaDirError::Read { source, .. } => TlsSetupError::CaDirUnreadable {
                dir: dir.value.clone(),
                origin: dir.origin.clone(),
                cause: source.to_string(),
            },
            _ => no_cas(),
        })?;
    let mut roots = rustls::RootCertStore::empty();
    roots.add_parsable_certificates(
        read.certificates
            .into_iter()
            .map(|ca| CertificateDer::from(ca.der)),
    );
    if roots.is_empty() {
        return Err(no_cas());
    }
    Ok(roots)
}

/// The rustls client configuration: trust `roots`, present `user` (read from `credentials`).
///
/// rustls's `with_client_auth_cert` parses the leaf with webpki, which refuses proxies (their
/// critical ProxyCertInfo), so the chain and key are handed over as a [`CertifiedKey`] through a
/// resolver, and whether the key belongs to the leaf is checked here by comparing public keys.
pub fn client_config(
    roots: rustls::RootCertStore,
    user: &UserCertificate,
    credentials: &Credentials,
) -> Result<rustls::ClientConfig, TlsSetupError> {
    let bad = |err: rustls::Error| TlsSetupError::BadIdentity {
        origin: credentials.origin.clone(),
        cause: err.to_string(),
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let signing_key = provider
        .key_provider
        .load_private_key(user.key.clone_key())
        .map_err(bad)?;
    let leaf_key = user.chain.first().and_then(|leaf| {
        x509_parser::parse_x509_certificate(leaf.as_ref())
            .ok()
            .map(|(_, cert)| cert.public_key().raw.to_vec())
    });
    if let (Some(key), Some(leaf)) = (signing_key.public_key(), leaf_key) {
        if key.as_ref() != leaf.as_slice() {
            return Err(TlsSetupError::KeyMismatch {
                cert: credentials.cert.clone(),
                key: credentials.key.clone(),
                origin: credentials.origin.clone(),
            });
        }
    }
    let certified = Arc::new(CertifiedKey::new(user.chain.clone(), signing_key));
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(bad)?
        .with_root_certificates(roots)
        .with_client_cert_resolver(Arc::new(Presented(certified))))
}

/// The rustls client configuration for a bearer token: trust `roots`, present no client
/// certificate (the token goes in the `Authorization` header).
pub fn token_client_config(
    roots: rustls::RootCertStore,
) -> Result<rustls::ClientConfig, TlsSetupError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|err| TlsSetupError::BadIdentity {
            origin: Origin::Default,
            cause: err.to_string(),
        })?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// Always presents the user's chain, whatever CAs the manager hints at (grid clients do the
/// same: the manager's CA directory decides).
#[derive(Debug)]
struct Presented(Arc<CertifiedKey>);

impl ResolvesClientCert for Presented {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[rustls::SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }

    fn has_certs(&self) -> bool {
        true
    }
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

    impl UserCertificate {
        fn load_now(credentials: &Credentials) -> Result<Self, TlsSetupError> {
            Self::load(credentials, None, Utc::now())
        }
    }

    /// Mode 0600, as a key or proxy file must have.
    fn private(path: &Path) {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
    }

    /// Runs x509/scripts/gridca.sh (openssl, grid-proxy-init).
    fn gridca(args: &[&str]) {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../x509/scripts/gridca.sh");
        let out = std::process::Command::new(script)
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "gridca.sh {args:?}: {out:?}");
    }

    fn grid_cas(dir: &Path) -> CaDir {
        CaDir::load(&dir.join("grid/certificates")).unwrap()
    }

    /// A grid CA with user `alice` in `dir`, and a proxy of hers made with `flags`.
    fn grid_proxy(dir: &Path, flags: &[&str]) -> Credentials {
        let grid = dir.join("grid");
        let grid_text = grid.to_str().unwrap();
        if !grid.exists() {
            gridca(&["ca", grid_text]);
            gridca(&["user", grid_text, "alice"]);
        }
        let proxy = dir.join(format!("proxy{}", flags.join("")));
        let mut args = vec!["proxy", grid_text, "alice", proxy.to_str().unwrap()];
        args.extend_from_slice(flags);
        gridca(&args);
        Credentials {
            cert: proxy.clone(),
            key: proxy,
            origin: Origin::Env("X509_USER_PROXY"),
        }
    }

    #[test]
    fn a_proxy_file_is_presented_whole_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let creds = grid_proxy(dir.path(), &["-valid", "0:1"]);
        let cas = grid_cas(dir.path());
        let loaded = UserCertificate::load(&creds, Some(&cas), Utc::now()).unwrap();
        assert_eq!(loaded.chain.len(), 2, "the proxy and the user certificate");
        assert_eq!(
            loaded.identity.as_deref(),
            Some("/DC=org/DC=ongrid-test/OU=People/CN=alice")
        );
        assert_eq!(
            loaded.issuer.as_deref(),
            Some("/DC=org/DC=ongrid-test/CN=ongrid test CA")
        );
        let not_after = loaded.not_after.unwrap();
        assert!(not_after <= Utc::now() + chrono::TimeDelta::seconds(61));
        assert!(loaded.check(&creds).is_ok());
        assert_eq!(loaded.kind(), Some(ProxyKind::Impersonation));
        // Without the CA, the manager decides; the holder and CA are still named.
        let unknown = UserCertificate::load(&creds, None, Utc::now()).unwrap();
        assert!(unknown.check(&creds).is_ok());
        assert_eq!(unknown.kind(), None);
        assert_eq!(unknown.identity, loaded.identity);
        assert_eq!(unknown.issuer, loaded.issuer);

        // An hour later (past the five minutes of tolerated skew) it is expired: one line that
        // names the file, where it came from, and voms-proxy-init.
        let later =
            UserCertificate::load(&creds, Some(&cas), not_after + chrono::TimeDelta::hours(1))
                .unwrap();
        let message = later.check(&creds).unwrap_err().to_string();
        assert!(
            message.starts_with(&format!(
                "cannot use {} (from X509_USER_PROXY): proxy expired at ",
                creds.cert.display()
            )),
            "{message}"
        );
        assert!(message.contains("voms-proxy-init"), "{message}");
        assert_eq!(later.identity, loaded.identity, "still named in messages");
    }

    #[test]
    fn legacy_proxies_are_refused_naming_rfc() {
        let dir = tempfile::tempdir().unwrap();
        let creds = grid_proxy(dir.path(), &["-old"]);
        let cas = grid_cas(dir.path());
        let loaded = UserCertificate::load(&creds, Some(&cas), Utc::now()).unwrap();
        let message = loaded.check(&creds).unwrap_err().to_string();
        assert!(message.contains("-rfc"), "{message}");
        let limited = grid_proxy(dir.path(), &["-limited"]);
        let loaded = UserCertificate::load(&limited, Some(&cas), Utc::now()).unwrap();
        assert!(loaded.check(&limited).is_ok());
        assert_eq!(loaded.kind(), Some(ProxyKind::Limited));
    }

    #[test]
    fn a_certificate_and_key_in_two_files_load() {
        let (_, _, proxy_key, proxy) = proxy_chain();
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
        std::fs::write(&cert, proxy.pem()).unwrap();
        std::fs::write(&key, proxy_key.serialize_pem()).unwrap();
        private(&key);
        let creds = Credentials {
            cert: cert.clone(),
            key: key.clone(),
            origin: Origin::Env("X509_USER_CERT"),
        };
        let loaded = UserCertificate::load_now(&creds).unwrap();
        assert_eq!(loaded.chain.len(), 1);
        let mut roots = rustls::RootCertStore::empty();
        roots.add(proxy.der().clone()).unwrap();
        assert!(client_config(roots, &loaded, &creds).is_ok());

        // The certificate may be public (it was written 0644); the key may not.
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o640)).unwrap();
        }
        let err = UserCertificate::load_now(&creds).unwrap_err();
        assert!(matches!(err, TlsSetupError::TooOpen(_)), "{err}");
        assert!(
            err.to_string()
                .starts_with(&format!("private key file {} has mode 0640", key.display()))
                && err
                    .to_string()
                    .ends_with(&format!("run `chmod 600 {}`", key.display())),
            "{err}"
        );
        private(&key);

        // The key is taken from the key file only (here the certificate's, made private so that
        // its mode is not what is refused).
        private(&cert);
        let swapped = Credentials {
            cert: key,
            key: cert,
            origin: Origin::Env("X509_USER_CERT"),
        };
        let err = UserCertificate::load_now(&swapped).unwrap_err();
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
        let err = UserCertificate::load_now(&creds("missing")).unwrap_err();
        assert!(
            err.to_string().starts_with(&format!(
                "cannot read certificate {} (from X509_USER_PROXY): ",
                dir.path().join("missing").display()
            )),
            "{err}"
        );

        std::fs::write(dir.path().join("certonly"), user.pem()).unwrap();
        private(&dir.path().join("certonly"));
        let err = UserCertificate::load_now(&creds("certonly")).unwrap_err();
        assert!(matches!(err, TlsSetupError::NoKey { .. }), "{err}");

        std::fs::write(dir.path().join("empty"), "not pem\n").unwrap();
        private(&dir.path().join("empty"));
        let err = UserCertificate::load_now(&creds("empty")).unwrap_err();
        assert!(matches!(err, TlsSetupError::NoCertificate { .. }), "{err}");

        let encrypted = format!(
            "{}-----BEGIN ENCRYPTED PRIVATE KEY-----\nAAAA\n-----END ENCRYPTED PRIVATE KEY-----\n",
            user.pem()
        );
        std::fs::write(dir.path().join("enc"), encrypted).unwrap();
        private(&dir.path().join("enc"));
        let err = UserCertificate::load_now(&creds("enc")).unwrap_err();
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
        private(&path);
        let creds = Credentials {
            cert: path.clone(),
            key: path,
            origin: Origin::Flag("cert"),
        };
        let loaded = UserCertificate::load_now(&creds).unwrap();
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
